"""What keeping a layer in float costs (enginekit/calibration/cost.py) and how the accuracy
search uses it: MACs per input row, a plan's float share, and the second order (most
sensitive per MAC) the search tries layers in."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from enginekit.calibration.cost import layer_macs, plan_cost
from enginekit.calibration.search import _orders


def conv_net() -> onnx.ModelProto:
    """x[b,4,16,16] -> conv 3x3 (4->8, pad 1) -> depthwise 3x3 (8, pad 1) -> Add(residual)
    -> flatten -> Gemm (2048 -> 10, transB)."""
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1] * 4, name="conv"),
        helper.make_node("Conv", ["a", "w2"], ["b"], pads=[1] * 4, group=8, name="dw"),
        helper.make_node("Add", ["a", "b"], ["c"], name="add"),
        helper.make_node("Flatten", ["c"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "w3"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [w("w1", 8, 4, 3, 3), w("w2", 8, 1, 3, 3), w("w3", 10, 2048)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_macs_per_row_of_convs_depthwise_gemm_and_an_elementwise_add():
    macs = layer_macs(conv_net(), ["conv", "dw", "add", "fc", "flat"])
    assert macs["conv"] == 8 * 16 * 16 * 4 * 9
    assert macs["dw"] == 8 * 16 * 16 * 9  # one input channel per output channel
    assert macs["add"] == 8 * 16 * 16  # one operation per output element
    assert macs["fc"] == 10 * 2048
    assert macs["flat"] == 2048  # no weight: its elements


def test_plan_cost_is_the_float_share_of_the_arithmetic():
    costs = {"a": 300.0, "b": 100.0}
    assert plan_cost(costs, []) == 0.0
    assert plan_cost(costs, ["b"]) == pytest.approx(0.25)
    assert plan_cost(costs, ["a", "b"]) == pytest.approx(1.0)
    assert plan_cost({}, ["a"]) == 0.0


def test_the_search_also_tries_the_cheap_sensitive_layers_first():
    sensitivity = [("early", 0.03), ("late", 0.02), ("middle", 0.001)]
    costs = {"early": 1000.0, "late": 10.0, "middle": 100.0}
    assert _orders(sensitivity, costs) == [["early", "late", "middle"], ["late", "early", "middle"]]
    # when both orders agree, the plans are measured once
    assert _orders(sensitivity, {"early": 1.0, "late": 1.0, "middle": 1.0}) == [
        ["early", "late", "middle"]
    ]
