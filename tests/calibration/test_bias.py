"""Bias correction (enginekit/calibration/bias.py): the mean shift that rounding the weights
causes is given back to the int32 bias."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.calibration.bias import biases_from, correct_bias, correct_bias_sequential
from enginekit.calibration.writers import write_qdq


def one_conv() -> onnx.ModelProto:
    """x[batch,8,6,6] -> Conv -> y: wide-ranging per-tensor weights, so the small ones round
    coarsely, and an input with a large mean, so the rounding shows as a mean shift."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 8, 3, 3)) * 0.05).astype(np.float32)
    w[0, 0, 0, 0] = 3.0  # one large weight sets the per-tensor scale
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], name="conv")],
        "one_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(4, np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_bias_correction_removes_the_mean_shift_of_rounded_weights():
    model = one_conv()
    rng = np.random.default_rng(1)
    x = (4.0 + rng.standard_normal((64, 8, 6, 6))).astype(np.float32)
    table = ek.calibrate(model, x[:32], method="minmax")
    qdq = write_qdq(model, table, style="onnxruntime-cpu", per_channel=False, reduce_range=True)
    fixed, layers = correct_bias(qdq, model, [{"x": x[:32]}])
    assert layers == ["conv"]
    ref = reference(model, {"x": x[32:]})["y"]
    before = np.abs((reference(qdq, {"x": x[32:]})["y"] - ref).mean(axis=(0, 2, 3)))
    after = np.abs((reference(fixed, {"x": x[32:]})["y"] - ref).mean(axis=(0, 2, 3)))
    assert after.max() < before.max() / 3
    # a copy: the Q/DQ model given is left as it was
    assert fixed is not qdq and qdq.graph.initializer != fixed.graph.initializer


def two_convs() -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> y, 8 channels: the Relu output's long tail is clipped by a
    low percentile range, which shifts the second Conv's output mean (an activation error no
    weight-only correction sees)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32)
    w2 = (np.abs(rng.standard_normal((8, 8, 1, 1))) * 0.3).astype(np.float32)
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1], name="c1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="c2"),
        ],
        "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 6, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_sequential_bias_correction_takes_off_the_mean_shift_of_clipped_activations():
    model = two_convs()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4, 6, 6)).astype(np.float32)
    table = ek.calibrate(model, x[:32], method="percentile").with_method("percentile", 90.0)
    qdq = write_qdq(model, table, style="onnxruntime-cpu", per_channel=True, reduce_range=True)
    analytic, _ = correct_bias(qdq, model, [{"x": x[:32]}])
    fixed, layers = correct_bias_sequential(analytic, model, [{"x": x[:32]}])
    assert layers == ["c1", "c2"]  # level by level, upstream first
    ref = reference(model, {"x": x[32:]})["y"]

    def shift(m: onnx.ModelProto) -> float:
        return float(np.abs((reference(m, {"x": x[32:]})["y"] - ref).mean(axis=(0, 2, 3))).max())

    # The weight-only correction leaves the clipping's shift; the sequential one removes it.
    assert shift(fixed) < shift(analytic) / 3
    assert fixed is not analytic and analytic.graph.initializer != fixed.graph.initializer


def test_biases_from_stops_the_sequential_correction_after_its_first_levels():
    model = two_convs()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 4, 6, 6)).astype(np.float32)
    table = ek.calibrate(model, x, method="percentile").with_method("percentile", 90.0)
    qdq = write_qdq(model, table, style="onnxruntime-cpu", per_channel=True, reduce_range=True)
    fixed, layers = correct_bias_sequential(qdq, model, [{"x": x}])

    def biases(m: onnx.ModelProto) -> dict[str, np.ndarray]:
        producer = {o: n for n in m.graph.node for o in n.output}
        init = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        return {
            n.name: init[producer[n.input[2]].input[0]] for n in m.graph.node if n.op_type == "Conv"
        }

    before, after = biases(qdq), biases(fixed)
    got = biases(biases_from(fixed, qdq, layers[:1]))
    assert not np.array_equal(before["c1"], after["c1"])
    np.testing.assert_array_equal(got["c1"], after["c1"])  # the first level corrected
    np.testing.assert_array_equal(got["c2"], before["c2"])  # the second one left as it was
    np.testing.assert_array_equal(biases(qdq)["c1"], before["c1"])  # the base is not edited
