"""Cross-layer equalization: float outputs unchanged, per-channel weight ranges equalized."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from enginekit.errors import BuildError
from enginekit.passes.equalize import equalize


def mobile_block(act: str = "Clip", seed: int = 0) -> onnx.ModelProto:
    """x -> pointwise Conv -> act -> depthwise Conv -> act -> pointwise Conv: a MobileNetV2
    inverted residual without the skip, with channel ranges spread over ~3 decades."""
    rng = np.random.default_rng(seed)
    c = 6
    spread = np.logspace(-1.5, 1.0, c).astype(np.float32)  # per-channel scale 0.03 .. 10

    def w(name: str, *shape: int, scale: np.ndarray | float = 1.0) -> onnx.TensorProto:
        a = rng.standard_normal(shape).astype(np.float32)
        if isinstance(scale, np.ndarray):
            a *= scale.reshape(-1, *([1] * (len(shape) - 1)))
        else:
            a *= scale
        return numpy_helper.from_array(a, name)

    inits = [
        w("w1", c, 3, 1, 1, scale=spread),
        w("b1", c, scale=0.5),
        w("w2", c, 1, 3, 3, scale=spread[::-1].copy()),
        w("b2", c, scale=0.5),
        w("w3", 4, c, 1, 1, scale=0.3),
        w("b3", 4, scale=0.1),
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
    ]

    def activation(x: str, y: str) -> onnx.NodeProto:
        if act == "Clip":
            return helper.make_node("Clip", [x, "lo", "hi"], [y], name=f"clip_{y}")
        return helper.make_node("Relu", [x], [y], name=f"relu_{y}")

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="expand"),
        activation("c1", "a1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], group=c, pads=[1] * 4, name="dw"),
        activation("c2", "a2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["y"], name="project"),
    ]
    graph = helper.make_graph(
        nodes, "mobile_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def ranges(model: onnx.ModelProto, name: str, axis: int) -> np.ndarray:
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))
    return np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)


@pytest.mark.parametrize("act", ["Relu", "Clip"])
def test_outputs_unchanged_and_ranges_equalized(act: str) -> None:
    model = mobile_block(act)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32) * 3
    out, info = equalize(model)
    onnx.checker.check_model(out)
    np.testing.assert_allclose(run(out, x), run(model, x), rtol=1e-4, atol=1e-4)
    assert len(info.pairs) == 2
    assert info.spread_after < info.spread_before / 10
    # Both pairs end equalized: expand's output channels match dw's, dw's match project's input.
    np.testing.assert_allclose(ranges(out, "w1", 0), ranges(out, "w2", 0), rtol=1e-2)
    np.testing.assert_allclose(ranges(out, "w2", 0), ranges(out, "w3", 1), rtol=1e-2)
    assert (len(info.clips_rewritten) == 2) == (act == "Clip")
    assert "Clip" not in {n.op_type for n in out.graph.node}


def test_clip_pairs_skipped_when_asked() -> None:
    model = mobile_block("Clip")
    out, info = equalize(model, clip="skip")
    assert info.pairs == () and info.clips_rewritten == ()
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]


def test_source_untouched_and_bad_mode_named() -> None:
    model = mobile_block("Relu")
    before = model.SerializeToString()
    equalize(model)
    assert model.SerializeToString() == before
    with pytest.raises(BuildError, match="clip='scale'.*scaled, skip"):
        equalize(model, clip="scale")
