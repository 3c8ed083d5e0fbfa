"""Sum-preserving weight rounding (enginekit/calibration/rounding.py): each output channel's
integer weights sum to the rounded float sum, every weight stays within one step, and a
depthwise edge detector on a smooth input stops leaking the input's level."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.calibration.rounding import preserve_sums
from enginekit.calibration.writers import write_qdq


def edge_detectors() -> onnx.ModelProto:
    """x[batch,16,8,8] -> depthwise 3x3 Conv: large zero-sum kernels (MobileNetV2's first
    depthwise layer after BatchNorm folding), so nearest rounding moves each kernel's sum."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 1, 3, 3)) * 5
    w -= w.mean(axis=(2, 3), keepdims=True)  # each kernel sums to 0
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=16, pads=[1] * 4, name="dw")],
        "edge_detectors",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 8, 8])],
        [
            numpy_helper.from_array(w.astype(np.float32), "w"),
            numpy_helper.from_array(np.zeros(16, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _weights(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray]:
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in init
              and init[n.input[0]].ndim == 4)  # fmt: skip
    return init[dq.input[0]].astype(np.int64), init[dq.input[1]].astype(np.float64)


def test_sums_kept_each_weight_within_a_step_and_the_leak_gone():
    source = edge_detectors()
    # A smooth, positive input (a ReLU6 output on a flat region) at a few levels.
    x = np.broadcast_to(np.linspace(1, 5, 4, dtype=np.float32).reshape(4, 1, 1, 1), (4, 16, 8, 8))
    x = np.ascontiguousarray(x)
    table = ek.calibrate(source, {"x": x}, method="minmax")
    qdq = write_qdq(source, table, style="onnxruntime-cpu")
    fixed, layers = preserve_sums(qdq, source)
    assert layers == ["dw"]
    w = numpy_helper.to_array(source.graph.initializer[0]).astype(np.float64).reshape(16, -1)
    q0, scale = _weights(qdq)
    q1, _ = _weights(fixed)
    q0, q1, scale = q0.reshape(16, -1), q1.reshape(16, -1), scale.reshape(16, 1)
    exact = w / scale
    assert np.all(np.abs(q1.sum(axis=1) - np.round(exact.sum(axis=1))) == 0)
    assert np.all(np.abs(q1 - exact) <= 1.0) and np.abs(q1).max() <= np.abs(q0).max()
    # On the flat interior the float output is 0; the re-rounded kernels leak (almost) nothing.
    inner = (slice(None), slice(None), slice(1, -1), slice(1, -1))
    before = np.abs(reference(qdq, {"x": x})["y"][inner]).mean()
    after = np.abs(reference(fixed, {"x": x})["y"][inner]).mean()
    assert after < before / 4
    # The source and the Q/DQ model handed in are untouched.
    assert _weights(qdq)[0].tolist() == q0.reshape(16, 1, 3, 3).tolist()
