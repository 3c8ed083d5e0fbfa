"""Precision plans produce ONNX models that pass onnx.checker and match the fp32 reference on ONNX
Runtime within the precision's tolerance (enginekit/backends/tensorrt/precision.py and the
backend's ``network_model``). Runs without TensorRT: the rewrite is what TensorRT 11 parses.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import trt_models

from enginekit.backends import tensorrt as backend
from enginekit.backends.tensorrt import plan, precision
from enginekit.config import DEFAULT_TOLERANCE, BuildConfig, Precision, normalize_shapes
from enginekit.errors import BuildError
from enginekit.model import load_model


def run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime CPU at the basic level (1.32's full level segfaults on some fp16 graphs)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(
        proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def assert_close(got, want, precision_: Precision) -> None:
    atol, rtol = DEFAULT_TOLERANCE[precision_]
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=atol, rtol=rtol)


def planned(proto: onnx.ModelProto, precision_: str, version: str = "11.0.0", **options):
    model = load_model(proto)
    shape = [d if isinstance(d, int) else 4 for d in model.inputs[0].shape]
    lo, hi = [1, *shape[1:]], [16, *shape[1:]]
    config = BuildConfig(
        backend="tensorrt",
        profiles=normalize_shapes({model.inputs[0].name: [lo, shape, hi]}),
        precision=precision_,
        device="cuda",
        options=options,
    )
    return model, plan.plan_build(model, config, version, has_quantizer="quantizer" in options)


FEEDS = {
    "mlp": {"x": np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)},
    "convnet": {"x": np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)},
}


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_fp32_plan_leaves_the_model_as_it_is(name):
    proto = getattr(trt_models, name)()
    model, p = planned(proto, "fp32")
    out, calibration = backend.network_model(model, p)
    assert out is model.proto and calibration is None


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_fp16_plan_rewrites_to_a_valid_model_matching_fp32_within_fp16_tolerance(name):
    proto = getattr(trt_models, name)()
    model, p = planned(proto, "fp16")
    out, _ = backend.network_model(model, p)
    onnx.checker.check_model(out, full_check=True)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in out.graph.initializer)
    assert [i.type.tensor_type.elem_type for i in out.graph.input] == [onnx.TensorProto.FLOAT]
    assert_close(run(out, FEEDS[name]), run(proto, FEEDS[name]), Precision.FP16)


@pytest.mark.slow
def test_fp16_rewrite_of_an_exported_cnn_matches(onnx_model):
    model = load_model(onnx_model("cnn"))
    out = precision.to_low_precision(model.proto, "fp16")
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.random.default_rng(3).standard_normal((4, 3, 16, 16)).astype(np.float32)}
    assert_close(run(out, feeds), run(model.proto, feeds), Precision.FP16)


def test_tensorrt_10_fp16_uses_builder_flags_and_no_rewrite():
    model, p = planned(trt_models.mlp(), "fp16", version="10.8.0.43")
    out, _ = backend.network_model(model, p)
    assert out is model.proto and p.precision.builder_flags == ("FP16",)


def test_bf16_rewrite_matches_fp32_within_bf16_tolerance():
    from onnx.reference import ReferenceEvaluator  # ONNX Runtime CPU has no bf16 kernels

    proto = trt_models.convnet()
    model, p = planned(proto, "bf16")
    out, _ = backend.network_model(model, p)
    onnx.checker.check_model(out, full_check=True)
    assert any(t.data_type == onnx.TensorProto.BFLOAT16 for t in out.graph.initializer)
    got = ReferenceEvaluator(out).run(None, FEEDS["convnet"])
    assert_close(got, run(proto, FEEDS["convnet"]), Precision.BF16)


def _consumer_inputs(proto: onnx.ModelProto, op: str) -> list[str]:
    return [i for n in proto.graph.node if n.op_type == op for i in n.input]


def test_ops_without_a_low_precision_schema_or_in_fp32_ops_stay_fp32():
    proto = trt_models.convnet()
    out = precision.to_low_precision(proto, "bf16")
    # MaxPool has no bf16 before opset 22: it is fed and read through casts to/from float32.
    assert _consumer_inputs(out, "MaxPool") == ["r__fp32"]
    # Pow is in the default fp32 ops: its input is cast back up.
    assert _consumer_inputs(out, "Pow")[0].endswith("__fp32")
    # Resize's scales input is float32 by its schema and stays so.
    assert _consumer_inputs(out, "Resize")[2] == "scales"
    kept = precision.to_low_precision(proto, "fp16", fp32_ops=["Gemm"])
    assert _consumer_inputs(kept, "Gemm")[0].endswith("__fp32")
    assert "fc_w" in {t.name for t in kept.graph.initializer}


def test_low_precision_rewrite_refuses_control_flow():
    with pytest.raises(BuildError, match="subgraph.*strongly_typed=false"):
        precision.to_low_precision(trt_models.with_if(), "fp16")


# -- int8 --------------------------------------------------------------------------------------------


def quantize(proto: onnx.ModelProto, tmp_path, symmetric: bool = True) -> onnx.ModelProto:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.batches = iter(
                [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(16)]
            )

        def get_next(self):
            return next(self.batches, None)

    src, dst = tmp_path / "float.onnx", tmp_path / f"qdq-{symmetric}.onnx"
    onnx.save(proto, src)
    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        extra_options={
            "ActivationSymmetric": symmetric,
            "WeightSymmetric": True,
            "QuantizeBias": False,
        },
    )
    return onnx.load(dst)


@pytest.fixture(scope="module")
def qdq_mlp(tmp_path_factory):
    return quantize(trt_models.mlp(), tmp_path_factory.mktemp("qdq"))


@pytest.mark.parametrize("version", ["10.8.0.43", "11.0.0"])
def test_int8_plan_from_a_quantize_callable_matches_fp32_within_int8_tolerance(qdq_mlp, version):
    proto = trt_models.mlp()
    model, p = planned(proto, "int8", version=version, quantizer=True)
    out, calibration = backend.network_model(model, p, quantizer=lambda source: qdq_mlp)
    assert precision.has_qdq(out) and calibration == precision.model_sha256(qdq_mlp)
    onnx.checker.check_model(out, full_check=True)
    assert_close(run(out, FEEDS["mlp"]), run(proto, FEEDS["mlp"]), Precision.INT8)


def test_int8_plan_from_a_qdq_model_file(qdq_mlp, tmp_path):
    path = tmp_path / "q.onnx"
    onnx.save(qdq_mlp, path)
    model, p = planned(trt_models.mlp(), "int8", qdq_model=str(path))
    out, calibration = backend.network_model(model, p)
    assert calibration == precision.model_sha256(out)


def test_an_already_quantized_model_builds_int8_as_it_is(qdq_mlp):
    model, p = planned(qdq_mlp, "int8")
    out, calibration = backend.network_model(model, p)
    assert out is model.proto and calibration is None and p.precision.rewrite == "none"


def test_asymmetric_quantization_is_refused_naming_the_node(tmp_path):
    asym = quantize(trt_models.mlp(), tmp_path, symmetric=False)
    with pytest.raises(BuildError, match=r"DequantizeLinear node '\w+'.*zero point .* is not 0"):
        precision.check_qdq(asym, trt_models.mlp())


def test_qdq_model_of_another_model_is_refused(qdq_mlp):
    other = trt_models.single_op("Relu")
    with pytest.raises(BuildError, match="inputs .* differ from the source model"):
        precision.quantized_model(other, qdq_mlp)


def test_quantizer_returning_something_else_is_refused():
    with pytest.raises(BuildError, match="returned dict, expected an onnx.ModelProto"):
        precision.quantized_model(trt_models.mlp(), lambda m: {})


def test_float_model_passed_as_qdq_is_refused():
    with pytest.raises(BuildError, match="no QuantizeLinear/DequantizeLinear"):
        precision.quantized_model(trt_models.mlp(), trt_models.mlp())
