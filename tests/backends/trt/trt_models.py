"""Tiny ONNX models for the TensorRT planning tests, made with onnx.helper (no export, no GPU)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def mlp(batch: str | int = "batch", seed: int = 0) -> onnx.ModelProto:
    """x[batch, 16] -> MatMul/Add/Relu -> MatMul/Add -> Softmax -> y[batch, 4]."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    b1 = rng.standard_normal(32).astype(np.float32) * 0.1
    w2 = rng.standard_normal((32, 4)).astype(np.float32) * 0.3
    b2 = rng.standard_normal(4).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="fc2"),
        helper.make_node("Add", ["h3", "b2"], ["logits"], name="fc2_bias"),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        [_init("w1", w1), _init("b1", b1), _init("w2", w2), _init("b2", b2)],
    )
    return _model(graph)


def convnet(seed: int = 0) -> onnx.ModelProto:
    """A small CNN touching ops with special cases in the fp16/bf16 rewrite: Conv, MaxPool
    (no bf16 in ONNX), Resize (float32-only scales), Constant (value_float), Pow (kept fp32),
    ReduceMean, Flatten, Gemm; input x[batch, 3, 8, 8], outputs y[batch, 5] and energy[batch, 1].
    """
    rng = np.random.default_rng(seed)
    conv_w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    conv_b = rng.standard_normal(4).astype(np.float32) * 0.1
    fc_w = rng.standard_normal((5, 4)).astype(np.float32) * 0.3
    fc_b = rng.standard_normal(5).astype(np.float32) * 0.1
    scales = np.array([1, 1, 2, 2], np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Resize", ["p", "", "scales"], ["u"], name="up", mode="nearest"),
        helper.make_node("Constant", [], ["half"], name="half", value_float=0.5),
        helper.make_node("Mul", ["u", "half"], ["m"], name="scale"),
        helper.make_node("ReduceMean", ["m"], ["g"], name="gap", axes=[2, 3], keepdims=0),
        helper.make_node("Gemm", ["g", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
        helper.make_node("Constant", [], ["two"], name="two", value_float=2.0),
        helper.make_node("Pow", ["g", "two"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq"], ["energy"], name="energy", keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5]),
            helper.make_tensor_value_info("energy", TensorProto.FLOAT, ["batch", 1]),
        ],
        [
            _init("conv_w", conv_w),
            _init("conv_b", conv_b),
            _init("fc_w", fc_w),
            _init("fc_b", fc_b),
            _init("scales", scales),
        ],
    )
    return _model(graph)


def single_op(op: str, domain: str = "", opset: int = OPSET, **attrs: object) -> onnx.ModelProto:
    """x[2, 3] -> op -> y (float; types as the op leaves them)."""
    node = helper.make_node(op, ["x"], ["y"], name=f"the_{op.lower()}", domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    imports = [helper.make_opsetid("", opset)]
    if domain:
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports, ir_version=8)


def with_if(seed: int = 0) -> onnx.ModelProto:
    """A model with an If node (a subgraph): the low-precision rewrite refuses it."""
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),
    ]
    graph = helper.make_graph(
        nodes,
        "with_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [_init("zero", np.array(0, np.float32))],
    )
    return _model(graph)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model)
    return model
