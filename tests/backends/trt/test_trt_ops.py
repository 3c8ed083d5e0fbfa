"""The pre-build operator check against TensorRT's ONNX operator table (tensorrt/ops.py)."""

from __future__ import annotations

import numpy as np
import pytest
import trt_models
from onnx import TensorProto, helper, numpy_helper

from enginekit.backends import tensorrt as backend
from enginekit.backends.tensorrt import ops, plan
from enginekit.config import BuildConfig
from enginekit.errors import BuildError
from enginekit.model import load_model


def test_supported_models_pass():
    ops.check_ops(trt_models.mlp())
    ops.check_ops(trt_models.convnet())
    ops.check_ops(trt_models.with_if())


def test_supported_ops_lists_the_parser_table():
    listed = backend.supported_ops()
    assert {"Conv", "MatMul", "LayerNormalization", "QuantizeLinear"} <= set(listed)
    assert "Unique" not in listed and listed == sorted(listed)
    assert not ops.SUPPORTED & ops.UNSUPPORTED


def test_unsupported_op_is_named_with_its_node_before_building():
    with pytest.raises(BuildError, match=r"Unique \(1 node\(s\): 'the_unique'\): not supported"):
        ops.check_ops(trt_models.single_op("Unique"))


def test_op_missing_from_the_table_is_reported():
    problems = ops.find_problems(trt_models.single_op("Swish"))
    assert [p.op for p in problems] == ["Swish"] and "operator table" in problems[0].reason


def test_custom_domain_op_needs_a_plugin():
    with pytest.raises(
        BuildError, match="(?s)custom op of domain .com.example.*plugin.*check_ops=false"
    ):
        ops.check_ops(trt_models.single_op("FancyNorm", domain="com.example"))


def test_unsupported_op_inside_a_subgraph_is_found():
    model = trt_models.with_if()
    model.graph.node[2].attribute[0].g.node[0].op_type = "Det"
    assert [p.op for p in ops.find_problems(model)] == ["Det"]


def test_opset_outside_the_parser_range_is_reported():
    problems = ops.find_problems(trt_models.single_op("Relu", opset=8))
    assert problems and "opsets 9-24" in problems[0].reason


def _qdq_model(zero_point: int) -> object:
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="quant"),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dequant"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            numpy_helper.from_array(np.array(0.1, np.float32), "s"),
            numpy_helper.from_array(np.array(zero_point, np.int8), "zp"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_nonzero_qdq_zero_point_is_reported_but_zero_passes():
    assert ops.find_problems(_qdq_model(0)) == []
    problems = ops.find_problems(_qdq_model(3))
    assert {p.op for p in problems} == {"QuantizeLinear", "DequantizeLinear"}
    assert "symmetric" in problems[0].reason


def test_maxpool_indices_output_is_reported():
    node = helper.make_node("MaxPool", ["x"], ["y", "idx"], name="pool", kernel_shape=[2])
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("idx", TensorProto.INT64, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert [p.reason for p in ops.find_problems(model)] == ["the Indices output is unsupported"]


def test_the_backend_checks_ops_unless_told_not_to():
    model = load_model(trt_models.single_op("Unique"))
    config = BuildConfig(backend="tensorrt", device="cuda")
    with pytest.raises(BuildError, match="Unique"):
        backend.network_model(model, plan.plan_build(model, config, "10.8.0.43"))
    off = BuildConfig(backend="tensorrt", device="cuda", options={"check_ops": False})
    out, _ = backend.network_model(model, plan.plan_build(model, off, "10.8.0.43"))
    assert out is model.proto
