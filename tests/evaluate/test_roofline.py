"""``roofline``: FLOPs and bytes counted per node of hand-made graphs, floors from given rates."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from enginekit.errors import UsageError
from enginekit.evaluate.roofline import ModelCost, NodeCost, costs, floors, read_bandwidth


def _model(nodes, inputs, outputs, weights) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_grouped_conv_counts_macs_per_group_and_its_weight_bytes():
    # 8 -> 16 channels in 4 groups, 3x3, stride 1, pad 1, on 10x10: weight [16, 2, 3, 3]
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1, 1, 1, 1])
    relu = helper.make_node("Relu", ["y"], ["z"])
    model = _model([conv, relu], [("x", ["n", 8, 10, 10])], ["z"],
                   {"w": (16, 2, 3, 3), "b": (16,)})  # fmt: skip
    cost = costs(model, batch=2)
    c, r = cost.nodes
    assert (c.op, r.op) == ("Conv", "Relu")
    assert c.flops == 2 * (2 * 16 * 10 * 10) * (2 * 3 * 3)
    assert c.weight_bytes == (16 * 2 * 3 * 3 + 16) * 4 == cost.weight_bytes
    assert c.activation_bytes == (2 * 8 * 100 + 2 * 16 * 100) * 4
    assert r.flops == 0 and r.weight_bytes == 0 and r.activation_bytes == 2 * 2 * 16 * 100 * 4
    assert cost.shapes == {"x": (2, 8, 10, 10)} and cost.unknown == ()


def test_depthwise_conv_and_conv_transpose_count_their_own_macs():
    dw = helper.make_node("Conv", ["x", "w"], ["y"], group=8, strides=[2, 2])  # 3x3 valid, s2
    up = helper.make_node("ConvTranspose", ["y", "u"], ["z"], strides=[2, 2])
    model = _model([dw, up], [("x", [1, 8, 9, 9])], ["z"],
                   {"w": (8, 1, 3, 3), "u": (8, 4, 2, 2)})  # fmt: skip
    d, t = costs(model).nodes
    assert d.flops == 2 * (8 * 4 * 4) * (1 * 3 * 3)
    assert t.flops == 2 * (8 * 4 * 4) * (4 * 2 * 2)  # each input element feeds 4 ch x 2x2
    assert t.weight_bytes == 8 * 4 * 2 * 2 * 4


def test_gemm_with_transposes_and_matmul_of_two_activations():
    gemm = helper.make_node("Gemm", ["a", "w", "c"], ["y"], transA=1, transB=1)
    mm = helper.make_node("MatMul", ["q", "k"], ["s"])
    model = _model([gemm, mm], [("a", [5, 3]), ("q", [2, 4, 6, 8]), ("k", [2, 4, 8, 7])],
                   ["y", "s"], {"w": (9, 5), "c": (9,)})  # fmt: skip
    cost = costs(model)
    g, m = cost.nodes
    assert g.flops == 2 * 3 * 9 * 5  # A^T [3, 5] x W^T [5, 9]
    assert g.weight_bytes == (45 + 9) * 4
    assert m.flops == 2 * (2 * 4 * 6 * 7) * 8 and m.weight_bytes == 0
    assert cost.flops == g.flops + m.flops


def test_a_weight_read_by_two_nodes_counts_once_in_the_model_total():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("MatMul", ["h", "w"], ["y"])]  # fmt: skip
    cost = costs(_model(nodes, [("x", [1, 4])], ["y"], {"w": (4, 4)}))
    assert [n.weight_bytes for n in cost.nodes] == [64, 64] and cost.weight_bytes == 64


def test_a_symbolic_dim_without_a_size_is_a_usage_error_naming_the_input():
    model = _model([helper.make_node("Relu", ["ids"], ["y"])], [("ids", ["batch", "seq"])],
                   ["y"], {})  # fmt: skip
    with pytest.raises(UsageError, match=r"input 'ids' dim 0 is symbolic \('batch'\).*batch=N"):
        costs(model)
    with pytest.raises(UsageError, match=r"input 'ids' dim 1 is symbolic \('seq'\)"):
        costs(model, batch=1)
    with pytest.raises(UsageError, match="rank 2"):
        costs(model, shapes={"ids": (1, 2, 3)})
    with pytest.raises(UsageError, match=r"\['idz'\], not inputs"):
        costs(model, shapes={"idz": (1, 2)})
    assert costs(model, shapes={"ids": (3, 5)}).nodes[0].activation_bytes == 2 * 15 * 4


def test_the_model_given_is_not_modified():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", ["n", 2])], ["y"], {})
    before = model.SerializeToString()
    costs(model, batch=4)
    assert model.SerializeToString() == before


def _cost(*nodes: tuple[float, int, int]) -> ModelCost:
    made = tuple(NodeCost(f"n{i}", "Conv", f, w, a) for i, (f, w, a) in enumerate(nodes))
    return ModelCost({}, made, sum(n.weight_bytes for n in made))


def test_floors_from_given_rates():
    # 100 GFLOP/s, 10 GB/s, 1000-byte cache.
    # node 0: 2e6 FLOP (20 us) vs 100 B of weights (0.01 us): compute-bound, 20 us
    # node 1: 1e5 FLOP (1 us) vs 40_000 B weights + (3000 - 1000) B activations (4.2 us)
    cost = _cost((2e6, 100, 500), (1e5, 40_000, 3000))
    f = floors(cost, peak_gflops=100, bandwidth_gbs=10, cache_bytes=1000)
    assert f.compute_ms == pytest.approx(2.1e6 / 100e9 * 1e3)
    assert f.weights_ms == pytest.approx(40_100 / 10e9 * 1e3)
    assert f.serial_ms == pytest.approx((20e-6 + 4.2e-6) * 1e3)
    assert f.bound_ms == pytest.approx(4.2e-6 * 1e3)
    # 1000 bytes of node 1's weights kept in the cache save 0.1 us
    assert f.resident_ms == pytest.approx((20e-6 + 4.1e-6) * 1e3)
    # a cache big enough for every weight brings node 1 down to its compute time, no lower
    big = floors(cost, peak_gflops=100, bandwidth_gbs=10, cache_bytes=10**9)
    assert big.resident_ms == pytest.approx(21e-6 * 1e3)
    assert big.serial_ms == pytest.approx((20e-6 + 4e-6) * 1e3)  # activations fit: not counted
    with pytest.raises(UsageError, match="positive rates"):
        floors(cost, peak_gflops=0, bandwidth_gbs=10)


def test_read_bandwidth_is_a_positive_rate():
    assert read_bandwidth(threads=1, nbytes=1 << 20, repeats=1) > 0
    with pytest.raises(UsageError, match="threads=0"):
        read_bandwidth(threads=0)


def test_shapes_recorded_for_another_input_size_are_inferred_afresh():
    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    model = _model([conv, helper.make_node("Relu", ["y"], ["z"])], [("x", ["n", 2, 8, 8])],
                   ["z"], {"w": (4, 2, 3, 3)})  # fmt: skip
    model = onnx.shape_inference.infer_shapes(model)  # records y and z at 8x8, as exports do
    assert model.graph.value_info
    conv_cost = costs(model, shapes={"x": (1, 2, 32, 32)}).nodes[0]
    assert conv_cost.flops == 2 * (4 * 32 * 32) * (2 * 3 * 3)
