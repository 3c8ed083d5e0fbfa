"""bf16 and fp16 engines: reduced weights and activations, float32 statistics, float32 IO."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from xla_graphs import model  # noqa: E402

import enginekit as ek  # noqa: E402
from enginekit.backends.xla import lower  # noqa: E402
from enginekit.errors import BuildError  # noqa: E402

LOWEST = np.finfo(np.float32).min


def _attention_block():
    """x [batch, 8, 16], mask [batch, 8] -> MatMul -> scores + (1 - mask) * float32.lowest ->
    Softmax -> LayerNorm: the masking GPT-2 and BERT exports use."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) * 0.3).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.float32(1.0), "one"),
        numpy_helper.from_array(np.float32(LOWEST), "lowest"),
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
        numpy_helper.from_array(np.asarray([1], np.int64), "axis1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "qt"], ["scores"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["inv"]),
        helper.make_node("Mul", ["inv", "lowest"], ["bias"]),
        helper.make_node("Unsqueeze", ["bias", "axis1"], ["bias3"]),
        helper.make_node("Add", ["scores", "bias3"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "q"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1]),
        helper.make_node("LayerNormalization", ["ctxt", "gamma", "beta"], ["y"], axis=-1),
    ]
    return model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 8])],
        inits,
    )


def _feeds(batch: int = 2):
    rng = np.random.default_rng(1)
    mask = np.ones((batch, 8), np.int64)
    mask[0] = 0  # a fully masked row: uniform attention in float32
    mask[-1, 5:] = 0
    return {"x": rng.standard_normal((batch, 8, 16)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_engine_verifies_and_round_trips(precision, tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_attention_block()), path)
    shapes = {"x": [(1, 8, 16), (2, 8, 16), (4, 8, 16)], "mask": [(1, 8), (2, 8), (4, 8)]}
    built = ek.build(
        path,
        backend="xla",
        precision=precision,
        shapes=shapes,
        output=tmp_path / "e.ekit",
        xla_flags="xla-default",
    )
    assert built.manifest["verify"]["passed"]
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    with ek.load(tmp_path / "e.ekit") as engine:
        weight_types = {a.dtype.name for a in engine.exported.in_avals[:1]}
        assert weight_types == {low}
        out = engine.infer(_feeds())["y"]
    assert out.dtype == np.float32
    meta = built.manifest["backend"]["metadata"]["precision"]
    assert meta["weights_and_activations"] == precision
    assert "Softmax" in meta["float32_ops"]


def test_masking_with_float32_lowest_survives_bf16():
    """Narrowing saturates: float32.lowest becomes bf16's lowest, not -inf, so a fully masked
    row stays a uniform softmax (as in float32) instead of NaN."""
    m = _attention_block()
    feeds = _feeds()
    outs = {}
    for precision in ("fp32", "bf16"):
        lowered = lower.lower(m, precision=precision)
        with jax.enable_x64(True):
            (y,) = jax.jit(lowered.fn)(lowered.weights, (feeds["x"], feeds["mask"]))
        outs[precision] = np.asarray(y, np.float32)
    assert not np.isnan(outs["bf16"]).any()
    np.testing.assert_allclose(outs["bf16"], outs["fp32"], atol=0.1)


def test_int8_is_refused_with_the_precisions_the_backend_builds(tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_attention_block()), path)
    with pytest.raises(BuildError, match=r"fp32, bf16, fp16"):
        ek.build(path, backend="xla", precision="int8", shapes={"x": (1, 8, 16), "mask": (1, 8)})
