"""Tiny ONNX graphs built with onnx.helper for the XLA backend's tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Rng:
    """A fresh seeded generator per graph, so a builder called twice gives identical weights."""

    gen = np.random.default_rng(0)

    def reset(self) -> None:
        _Rng.gen = np.random.default_rng(0)

    def __getattr__(self, name: str):
        return getattr(_Rng.gen, name)


RNG = _Rng()


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def _weights(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    opset: int = 20,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8 if opset < 21 else 10
    return m


def image(name: str = "x", channels: int = 3, size: int = 8) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", channels, size, size])


def cnn(opset: int) -> onnx.ModelProto:
    """The same small CNN written the way opset ``opset`` spells it (9 or 20).

    Conv -> BatchNormalization -> Clip -> MaxPool -> Pad -> Conv -> Relu -> ReduceMean ->
    Squeeze -> Unsqueeze -> Flatten -> Split -> Concat -> Gemm -> Softmax: the ops whose
    attributes became inputs between the two opsets (Clip, Pad, ReduceMean, Squeeze,
    Unsqueeze, Split), and Softmax, whose semantics changed at 13.
    """
    RNG.reset()
    old = opset < 13
    inits = [
        _init("w1", _weights(8, 3, 3, 3)),
        _init("b1", _weights(8)),
        _init("scale", (RNG.uniform(0.5, 1.5, 8)).astype(np.float32)),
        _init("bias", _weights(8)),
        _init("mean", _weights(8)),
        _init("var", RNG.uniform(0.5, 2.0, 8).astype(np.float32)),
        _init("w2", _weights(16, 8, 3, 3)),
        _init("fc", _weights(10, 16)),
        _init("fc_b", _weights(10)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"]),
    ]
    if old:
        nodes.append(helper.make_node("Clip", ["bn"], ["clip"], min=0.0, max=6.0))
    else:
        inits += [_init("lo", np.array(0.0, np.float32)), _init("hi", np.array(6.0, np.float32))]
        nodes.append(helper.make_node("Clip", ["bn", "lo", "hi"], ["clip"]))
    nodes.append(
        helper.make_node("MaxPool", ["clip"], ["pool"], kernel_shape=[2, 2], strides=[2, 2])
    )
    pads = [0, 0, 1, 1, 0, 0, 1, 1]
    if old:
        nodes.append(helper.make_node("Pad", ["pool"], ["padded"], pads=pads))
    else:
        inits.append(_init("pads", np.array(pads, np.int64)))
        nodes.append(helper.make_node("Pad", ["pool", "pads"], ["padded"]))
    nodes += [
        helper.make_node("Conv", ["padded", "w2"], ["c2"]),
        helper.make_node("Relu", ["c2"], ["r2"]),
    ]
    if old:
        nodes += [
            helper.make_node("ReduceMean", ["r2"], ["gap"], axes=[2, 3], keepdims=1),
            helper.make_node("Squeeze", ["gap"], ["sq"], axes=[3]),
            helper.make_node("Unsqueeze", ["sq"], ["unsq"], axes=[3]),
        ]
    else:
        inits += [
            _init("hw", np.array([2, 3], np.int64)),
            _init("last", np.array([3], np.int64)),
        ]
        nodes += [
            helper.make_node("ReduceMean", ["r2", "hw"], ["gap"], keepdims=1),
            helper.make_node("Squeeze", ["gap", "last"], ["sq"]),
            helper.make_node("Unsqueeze", ["sq", "last"], ["unsq"]),
        ]
    nodes.append(helper.make_node("Flatten", ["unsq"], ["flat"]))
    if old:
        nodes.append(helper.make_node("Split", ["flat"], ["s1", "s2"], axis=1, split=[6, 10]))
    else:
        inits.append(_init("sizes", np.array([6, 10], np.int64)))
        nodes.append(helper.make_node("Split", ["flat", "sizes"], ["s1", "s2"], axis=1))
    nodes += [
        helper.make_node("Concat", ["s2", "s1"], ["cat"], axis=1),
        helper.make_node("Gemm", ["cat", "fc", "fc_b"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
    ]
    out = helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])
    return model(nodes, [image()], [out], inits, opset)


def conv_chain() -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Add (residual) -> BatchNorm -> MaxPool -> Sigmoid -> Mul: an
    all-NHWC-able chain, so the lowering should transpose only at the input and output."""
    RNG.reset()
    c = 8
    inits = [
        _init("w1", _weights(c, 3, 3, 3)),
        _init("w2", _weights(c, c, 3, 3)),
        _init("skip", _weights(c, 3, 1, 1)),
        _init("scale", np.ones(c, np.float32)),
        _init("bias", _weights(c)),
        _init("mean", _weights(c)),
        _init("var", np.ones(c, np.float32)),
        _init("gain", _weights(c, 1, 1)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "skip"], ["s"]),
        helper.make_node("Add", ["c2", "s"], ["sum"]),
        helper.make_node("BatchNormalization", ["sum", "scale", "bias", "mean", "var"], ["bn"]),
        helper.make_node("MaxPool", ["bn"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Sigmoid", ["pool"], ["sig"]),
        helper.make_node("Mul", ["sig", "gain"], ["y"]),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, 4, 4])
    return model(nodes, [image()], [out], inits)


def with_node(op: str, name: str, domain: str = "") -> onnx.ModelProto:
    """x -> Relu -> <op> (named ``name``) -> y."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(op, ["r"], ["y"], name=name, domain=domain),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = model(nodes, [x], [y])
    if domain:
        m.opset_import.append(helper.make_opsetid(domain, 1))
    return m


def reshape_by_input() -> onnx.ModelProto:
    """Reshape whose target shape is a graph input: data-dependent, so not compilable."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    s = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="by_input")], [x, s], [y])


def shape_chain() -> onnx.ModelProto:
    """x[batch, 4, 6] -> Shape -> Gather(0) -> Unsqueeze -> Concat(-1) -> Reshape: flatten."""
    inits = [
        _init("zero", np.array(0, np.int64)),
        _init("axis0", np.array([0], np.int64)),
        _init("minus1", np.array([-1], np.int64)),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 24])
    return model(nodes, [x], [y], inits)


def quantized_conv() -> onnx.ModelProto:
    """int8 kernel -> DequantizeLinear (per output channel) -> Conv."""
    RNG.reset()
    q = RNG.integers(-100, 100, (8, 3, 3, 3)).astype(np.int8)
    inits = [
        _init("wq", q),
        _init("wscale", RNG.uniform(0.001, 0.01, 8).astype(np.float32)),
        _init("wzero", np.zeros(8, np.int8)),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "wscale", "wzero"], ["w"], axis=0),
        helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 8, 8])
    return model(nodes, [image()], [out], inits)


def batch_mixing() -> onnx.ModelProto:
    """y = x - mean over the batch: rows interact, so padding a batch would change results."""
    inits = [_init("axes", np.array([0], np.int64))]
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    return model(nodes, [x], [y], inits)


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Collects one entry per XLA backend compile made inside the ``with`` block."""
    import jax
    from jax._src import monitoring as internal

    seen: list[str] = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        internal.unregister_event_duration_listener(listen)
