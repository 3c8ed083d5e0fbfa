"""OpenVINO's ``f32_layers`` option: named layers kept in f32 where the rest computes in bf16
(the mark goes through the IR; enginekit/backends/openvino/marks.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import CASES

import enginekit as ek
from enginekit import target
from enginekit.errors import BuildError

ov = pytest.importorskip("openvino")
ov_backend = pytest.importorskip("enginekit.backends.openvino")
from enginekit.backends.openvino import marks  # noqa: E402

SHAPES = CASES["cnn"].shapes


def _convs(path) -> list[str]:
    return [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]


def _marked(ov_model) -> set[str]:
    return {
        op.get_friendly_name()
        for op in ov_model.get_ordered_ops()
        if "DisablePrecisionConversion_0" in list(op.get_rt_info().keys())
    }


def test_marks_reach_the_model_read_back_from_the_ir(onnx_model, tmp_path):
    """Any host: the first conv, its bias Add and its Relu carry OpenVINO's keep-precision
    attribute once the IR is read back; the second conv and the classifier do not."""
    path = onnx_model("cnn")
    first, second = _convs(path)
    model = ov.Core().read_model(str(path))
    names, quantized = marks.ops_to_mark(model, [first])
    assert quantized == []
    xml = tmp_path / "m.xml"
    ov.save_model(model, str(xml), compress_to_fp16=False)
    assert marks.mark_ir(xml, names) == len(names)
    back = _marked(ov.Core().read_model(str(xml), str(tmp_path / "m.bin")))
    assert back == names
    kinds = {op.get_type_name() for op in model.get_ordered_ops() if op.get_friendly_name() in back}
    assert {"Convolution", "Relu"} <= kinds, kinds
    assert not any(n == second or n.startswith(second + "/") for n in back), back


def test_a_name_not_in_the_model_is_a_build_error_naming_the_closest(onnx_model):
    first = _convs(onnx_model("cnn"))[0]
    model = ov.Core().read_model(str(onnx_model("cnn")))
    with pytest.raises(BuildError, match=f"no node 'node_Conv_61'.*did you mean '{first}'"):
        marks.ops_to_mark(model, ["node_Conv_61"])


@pytest.mark.parametrize("value", [3, ["a", 4]])
def test_a_value_that_is_not_names_is_a_build_error(value):
    with pytest.raises(BuildError, match="f32_layers=.*expected ONNX node names"):
        ov_backend.parse_options({"f32_layers": value})


def test_comma_separated_names_are_split():
    assert ov_backend.parse_options({"f32_layers": "a, b,"}).f32_layers == ("a", "b")


def test_f32_layers_need_a_bf16_float_part(onnx_model):
    path = onnx_model("cnn")
    with pytest.raises(BuildError, match="computes its float part in f32 already"):
        ek.build(path, backend="openvino", shapes=SHAPES, f32_layers=_convs(path)[:1])


def test_layers_an_int8_plan_quantizes_stay_unmarked(onnx_model, tmp_path):
    """In a Q/DQ model a quantized layer reads its input through a FakeQuantize: asking to keep
    it in f32 leaves it int8 (reported), so the search's plans can name any layer."""
    from enginekit.calibration.writers import write_qdq

    path = onnx_model("cnn")
    calib = np.random.default_rng(0).standard_normal((32, 3, 16, 16)).astype(np.float32)
    table = ek.calibrate(path, calib)
    qdq = tmp_path / "q.onnx"
    write_qdq(onnx.load(str(path)), table, qdq, style="onnxruntime-cpu")
    model = ov.Core().read_model(str(qdq))
    names, quantized = marks.ops_to_mark(model, _convs(path))
    assert quantized == _convs(path)
    assert names == set()


def test_named_convs_run_f32_kernels_the_rest_bf16(onnx_model, tmp_path):
    """On a CPU with native bf16: the named conv runs f32 kernels in the built engine and in
    the IR the artifact falls back to, the other conv bf16; outputs stay close to f32."""
    if not set(ov_backend._ISA["bf16"]) & target.cpu_flags():
        pytest.skip(f"this CPU has no avx512_bf16/amx_bf16 ({sorted(target.cpu_flags())})")
    path = onnx_model("cnn")
    first, second = _convs(path)
    engine = ek.build(path, backend="openvino", precision="bf16", shapes=SHAPES, verify=False,
                      f32_layers=[first], export="ir", output=tmp_path / "m.ekit")  # fmt: skip
    kept = engine.manifest["backend"]["metadata"]["f32_layers"]
    assert kept["layers"] == [first] and kept["ops_marked"] >= 2, kept
    for compiled in (engine.compiled, ek.load(tmp_path / "m.ekit").compiled):
        runs = marks.runtime_precisions(compiled)
        assert runs[f"{first}/WithoutBiases"] == "f32", runs
        assert runs[f"{second}/WithoutBiases"] == "bf16", runs
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32)
    ref = ek.build(path, backend="openvino", shapes=SHAPES).infer(x)
    out = engine.infer(x)
    name = next(iter(ref))
    assert np.allclose(out[name], ref[name], atol=0.05), np.abs(out[name] - ref[name]).max()
