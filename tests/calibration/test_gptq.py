"""GPTQ weight rounding (enginekit/calibration/gptq.py): the patches it measures its second
moments on are the Conv's own (dense and depthwise, strides and pads), and on correlated
inputs the re-rounded layer's output error is lower than nearest rounding's, with every weight
in its layer's range and the scales untouched."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.calibration.gptq import _patches, gptq_round
from enginekit.calibration.writers import write_qdq


def two_convs() -> onnx.ModelProto:
    """x[batch,8,10,10] -> dense 3x3 stride-2 Conv (16 out) -> depthwise 3x3 Conv."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    w2 = (rng.standard_normal((16, 1, 3, 3)) * 5).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["h"], strides=[2, 2], pads=[1, 1, 1, 1],
                         name="dense"),
        helper.make_node("Conv", ["h", "w2", "b2"], ["y"], group=16, pads=[1] * 4, name="dw"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 5, 5])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
            numpy_helper.from_array(w2, "w2"),
            numpy_helper.from_array(np.zeros(16, np.float32), "b2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def smooth(rows: int, seed: int) -> np.ndarray:
    """Positive, spatially and channel-wise correlated inputs (what a ReLU6 layer passes on)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 4, (rows, 1, 1, 1)) + rng.standard_normal((rows, 8, 1, 1)) * 0.3
    ramp = np.linspace(0, 1, 10).reshape(1, 1, 1, 10) * rng.uniform(-1, 1, (rows, 8, 1, 1))
    return (base + ramp + rng.standard_normal((rows, 8, 10, 10)) * 0.05).astype(np.float32)


def test_patches_reproduce_the_convolutions():
    model = two_convs()
    x = smooth(2, 0)
    nodes = {n.name: n for n in model.graph.node}
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    h = reference(model_with_output(model, "h"), {"x": x})["h"]
    dense = _patches(x, nodes["dense"], (3, 3), depthwise=False) @ init["w1"].reshape(16, -1).T
    assert np.allclose(dense, np.moveaxis(h, 1, -1).reshape(-1, 16), atol=1e-4)
    dw = _patches(h, nodes["dw"], (3, 3), depthwise=True)  # [C, P, 9]
    y = np.einsum("cpk,ck->cp", dw, init["w2"].reshape(16, 9))
    want = reference(model, {"x": x})["y"]
    assert np.allclose(y, np.moveaxis(want, 1, 0).reshape(16, -1), atol=1e-3)


def model_with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.append(onnx.ValueInfoProto(name=name))
    return out


def test_output_error_lower_than_nearest_rounding_and_weights_in_range():
    source = two_convs()
    fit, fresh = smooth(16, 1), smooth(16, 2)
    table = ek.calibrate(source, {"x": fit}, method="minmax")
    qdq = write_qdq(source, table, style="onnxruntime-cpu", reduce_range=True)
    before = [t.SerializeToString() for t in qdq.graph.initializer]
    moments: dict[str, np.ndarray] = {}
    fixed, layers = gptq_round(qdq, source, [{"x": fit[:8]}, {"x": fit[8:]}], moments)
    assert sorted(layers) == ["dense", "dw"] and sorted(moments) == ["dense", "dw"]
    assert [t.SerializeToString() for t in qdq.graph.initializer] == before  # input untouched
    old = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    new = {t.name: numpy_helper.to_array(t) for t in fixed.graph.initializer}
    for name, value in new.items():
        if value.dtype == np.int8 and value.ndim == 4:
            assert np.abs(value).max() <= np.abs(old[name]).max()  # 7-bit weights stay 7-bit
        elif value.dtype != np.int8:
            assert np.array_equal(value, old[name])  # scales, zero points, biases as they were
    # Each layer's own output error from its weights, on fresh rows and its float input:
    # what GPTQ minimizes (the Q/DQ model's output error also holds the activations' own).
    nodes = {n.name: n for n in source.graph.node}
    h = reference(model_with_output(source, "h"), {"x": fresh})["h"]
    for name, x, depthwise in (("dense", fresh, False), ("dw", h, True)):
        w = numpy_helper.to_array(init_of(source, nodes[name].input[1])).astype(np.float64)
        p = _patches(x, nodes[name], (3, 3), depthwise).astype(np.float64)

        errors = []
        for model in (qdq, fixed):
            diff = (dequantized(model, name) - w).reshape(16, -1)
            out = np.einsum("cpk,ck->cp", p, diff) if depthwise else p @ diff.T
            errors.append(float((out**2).mean()))
        assert errors[1] < 0.8 * errors[0], (name, errors)


def init_of(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def dequantized(model: onnx.ModelProto, layer: str) -> np.ndarray:
    """The float weights a layer of a Q/DQ model computes with."""
    node = next(n for n in model.graph.node if n.name == layer)
    dq = next(n for n in model.graph.node if node.input[1] in n.output)
    q, scale = (numpy_helper.to_array(init_of(model, i)) for i in dq.input[:2])
    return q.astype(np.float64) * scale.astype(np.float64).reshape(-1, 1, 1, 1)


def test_nothing_to_fit_on_changes_nothing():
    source = two_convs()
    table = ek.calibrate(source, {"x": smooth(4, 1)}, method="minmax")
    qdq = write_qdq(source, table, style="onnxruntime-cpu")
    fixed, layers = gptq_round(qdq, source, [])
    assert layers == [] and fixed.SerializeToString() == qdq.SerializeToString()
