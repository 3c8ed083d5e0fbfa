"""Writers: the Q/DQ model, TensorRT's calibration cache, ONNX Runtime's TensorRT EP table."""

from __future__ import annotations

import struct
import subprocess
import sys

import calib_models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import reference
from onnx import numpy_helper

from enginekit.calibration.writers import (
    qdq_scales,
    read_trt_cache,
    trt_version_number,
    write_ort_trt_table,
    write_qdq,
    write_trt_cache,
)
from enginekit.errors import CalibrationError

# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
other_model_path = calib_models.other_model_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def trt_qdq(tiny_cnn_path, tiny_table) -> onnx.ModelProto:
    return write_qdq(tiny_cnn_path, tiny_table)


def _inits(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def test_qdq_model_passes_the_checker_with_standard_ops_only(trt_qdq):
    onnx.checker.check_model(trt_qdq, full_check=True)
    assert {n.domain for n in trt_qdq.graph.node} <= {"", "ai.onnx"}
    assert {o.domain for o in trt_qdq.opset_import} <= {"", "ai.onnx"}
    ops = [n.op_type for n in trt_qdq.graph.node]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 6


def test_qdq_model_runs_in_onnxruntime_close_to_float(trt_qdq, tiny_cnn_path, calib_x):
    ref = _run(onnx.load(str(tiny_cnn_path)), calib_x)
    got = _run(trt_qdq, calib_x)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_tensorrt_style_scales_come_from_the_table_with_int8_zero_points(trt_qdq, tiny_table):
    inits = _inits(trt_qdq)
    scales = qdq_scales(trt_qdq)
    # Inputs of Conv and Gemm and the skip input of the residual Add, from the table.
    assert set(scales) == {"x", "r1", "f"}
    for name, scale in scales.items():
        assert float(scale) == pytest.approx(tiny_table.amax(name) / 127, rel=1e-6)
    for node in trt_qdq.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
            zp = inits[node.input[2]]
            assert zp.dtype == np.int8 and not zp.any()


def test_weights_per_channel_symmetric_and_biases_left_in_float(trt_qdq, tiny_table):
    inits = _inits(trt_qdq)
    dq_of = {n.output[0]: n for n in trt_qdq.graph.node if n.op_type == "DequantizeLinear"}
    conv1 = next(
        n for n in trt_qdq.graph.node if n.op_type == "Conv" and n.name.startswith("conv1")
    )
    weight_dq = dq_of[conv1.input[1]]
    assert inits[weight_dq.input[0]].dtype == np.int8
    w_scale = inits[weight_dq.input[1]]
    assert w_scale.shape == (8,)
    assert np.allclose(w_scale, np.asarray(tiny_table.weights["w1"].amax) / 127, rtol=1e-6)
    assert conv1.input[2] not in dq_of and inits[conv1.input[2]].dtype == np.float32


def test_residual_add_takes_the_conv_output_in_float_and_the_skip_quantized(trt_qdq):
    q_inputs = {n.input[0] for n in trt_qdq.graph.node if n.op_type == "QuantizeLinear"}
    assert not q_inputs & {"c1", "c2", "s", "logits"}  # outputs of Conv, Add, Gemm
    add = next(n for n in trt_qdq.graph.node if n.op_type == "Add")
    producers = {o: n.op_type for n in trt_qdq.graph.node for o in n.output}
    assert [producers[i] for i in add.input] == ["Conv", "DequantizeLinear"]


def test_onnxruntime_cpu_style_uses_uint8_activations(tiny_cnn_path, tiny_table, calib_x):
    proto = write_qdq(tiny_cnn_path, tiny_table, style="onnxruntime-cpu", reduce_range=True)
    onnx.checker.check_model(proto)
    inits = _inits(proto)
    zps = [
        inits[n.input[2]]
        for n in proto.graph.node
        if n.op_type == "QuantizeLinear" and len(n.input) > 2
    ]
    assert zps and all(z.dtype == np.uint8 for z in zps)
    ref = _run(onnx.load(str(tiny_cnn_path)), calib_x)
    assert (_run(proto, calib_x).argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_qdq_writer_refuses_a_table_of_another_model(other_model_path, tiny_table):
    with pytest.raises(CalibrationError, match="made for model"):
        write_qdq(other_model_path, tiny_table)


def test_qdq_writer_refuses_a_model_already_quantized(trt_qdq, tiny_table):
    with pytest.raises(CalibrationError, match="already carries QuantizeLinear"):
        write_qdq(trt_qdq, tiny_table, allow_table_mismatch=True)


def test_trt_cache_parses_back_to_the_same_scales(tiny_table, tmp_path):
    path = write_trt_cache(tiny_table, tmp_path / "calib.cache", trt_version="8.6.1")
    header, scales = read_trt_cache(path)
    assert header == "TRT-8601-EntropyCalibration2"
    assert set(scales) == set(tiny_table.tensors)
    for name, scale in scales.items():
        assert scale == np.float32(tiny_table.amax(name) / 127)
    line = next(x for x in path.read_text().splitlines() if x.startswith("x: "))
    assert struct.unpack(">f", bytes.fromhex(line[3:]))[0] == scales["x"]
    assert len(line[3:]) == 8


def test_trt_version_numbers_follow_nv_tensorrt_version():
    assert trt_version_number("8.6.1") == 8601
    assert trt_version_number("10.3.0") == 100300
    with pytest.raises(CalibrationError):
        trt_version_number("ten")


def test_bad_trt_cache_is_refused(tmp_path):
    (tmp_path / "a.cache").write_text("hello\n")
    with pytest.raises(CalibrationError, match="header"):
        read_trt_cache(tmp_path / "a.cache")
    (tmp_path / "b.cache").write_text("TRT-8601-EntropyCalibration2\nx: zz\n")
    with pytest.raises(CalibrationError, match=":2: not 'tensor"):
        read_trt_cache(tmp_path / "b.cache")


def test_ort_tensorrt_ep_table_holds_each_amax(tiny_table, tmp_path):
    files = write_ort_trt_table(tiny_table, tmp_path / "ort")
    assert files["flatbuffers"].stat().st_size > 0
    values = dict(line.split(" ") for line in files["cache"].read_text().splitlines())
    assert set(values) == set(tiny_table.tensors)
    assert float(values["c1"]) == pytest.approx(tiny_table.amax("c1"), rel=1e-6)


def test_calibrating_and_writing_qdq_import_no_framework():
    code = (
        "import sys, numpy as np, enginekit as ek, onnx\n"
        "sys.path.insert(0, 'tests/calibration'); from calib_models import tiny_cnn\n"
        "m = tiny_cnn()\n"
        "t = ek.calibrate(m, np.ones((2, 3, 8, 8), np.float32))\n"
        "from enginekit.calibration.writers import write_qdq; write_qdq(m, t)\n"
        "print([m for m in ('torch', 'tensorflow', 'jax') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tensorrt_style_passes_the_tensorrt_backends_own_checks(trt_qdq, tiny_cnn_path):
    trt = pytest.importorskip("enginekit.backends.tensorrt.precision", reason="TRT backend code")
    ops = pytest.importorskip("enginekit.backends.tensorrt.ops", reason="TRT backend code")
    trt.check_qdq(trt_qdq, onnx.load(str(tiny_cnn_path)))  # symmetric, constant zero points
    ops.check_ops(trt_qdq)  # every op in TensorRT's ONNX operator table


def test_models_past_the_protobuf_limit_go_through_external_data(
    monkeypatch, tiny_cnn_path, calib_x
):
    import enginekit as ek
    from enginekit.calibration import collect, writers

    monkeypatch.setattr(collect, "_LARGE_BYTES", 0)  # treat the tiny model as a 2 GiB one
    monkeypatch.setattr(writers, "_LARGE_BYTES", 0)
    table = ek.calibrate(tiny_cnn_path, calib_x[:8])
    proto = write_qdq(tiny_cnn_path, table)
    ref = _run(onnx.load(str(tiny_cnn_path)), calib_x[:8])
    assert (_run(proto, calib_x[:8]).argmax(1) == ref.argmax(1)).mean() >= 0.75


def _pointwise_then_depthwise() -> onnx.ModelProto:
    """x[batch,4,8,8] -> 1x1 Conv (4->8) -> ReLU6 -> depthwise 3x3 Conv (8 groups), biases."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 4, 1, 1)).astype(np.float32), "pw_w"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "pw_b"),
        numpy_helper.from_array((rng.standard_normal((8, 1, 3, 3)) * 4).astype(np.float32), "dw_w"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "dw_b"),
        numpy_helper.from_array(np.float32(0), "lo"),
        numpy_helper.from_array(np.float32(6), "hi"),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "pw_w", "pw_b"], ["p"], name="pw"),
        helper.make_node("Clip", ["p", "lo", "hi"], ["r"], name="relu6"),
        helper.make_node("Conv", ["r", "dw_w", "dw_b"], ["y"], group=8, pads=[1] * 4, name="dw"),
    ]
    graph = helper.make_graph(
        nodes, "pw_dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 8, 8])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_reduce_range_keeps_8_bit_weights_on_depthwise_convolutions():
    """7-bit weights (reduce_range) exist for the int16 pair sums of u8*s8 kernels without
    VNNI; depthwise kernels do not pair that way, so they keep all 8 bits (MobileNetV2:
    output NMSE 0.055 -> 0.038), with their int32 bias re-quantized at the new scale."""
    import enginekit as ek

    source = _pointwise_then_depthwise()
    x = np.random.default_rng(4).standard_normal((16, 4, 8, 8)).astype(np.float32)
    table = ek.calibrate(source, {"x": x}, method="minmax")
    qdq = write_qdq(source, table, style="onnxruntime-cpu", reduce_range=True)
    init = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    conv = {n.name: n for n in qdq.graph.node if n.op_type == "Conv"}

    def dequantized(name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        dq = producer[conv[name].input[k]]
        q, scale = init[dq.input[0]].astype(np.float64), init[dq.input[1]].astype(np.float64)
        return q, q * scale.reshape((-1,) + (1,) * (q.ndim - 1))

    assert np.abs(dequantized("pw", 1)[0]).max() <= 64  # 7 bits where the pairs saturate
    q, w = dequantized("dw", 1)
    assert np.abs(q).max() == 127
    source_w = numpy_helper.to_array(source.graph.initializer[2]).astype(np.float64)
    step = np.abs(source_w).reshape(8, -1).max(axis=1) / 127
    assert np.all(np.abs(w - source_w).reshape(8, -1).max(axis=1) <= step / 2 + 1e-6)
    _, bias = dequantized("dw", 2)  # at the new scale: the float bias within half a step
    source_b = numpy_helper.to_array(source.graph.initializer[3])
    assert np.allclose(bias, source_b, atol=1e-3)
    # The Q/DQ model still runs close to float, on ONNX Runtime's integer kernels.
    got, want = _run(qdq, x), reference(source, {"x": x})["y"]
    assert float(((got - want) ** 2).mean() / (want**2).mean()) < 1e-3
