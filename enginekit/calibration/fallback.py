"""Keep chosen layers of a Q/DQ model in float: the graph edit behind accuracy-aware int8.

A Q/DQ model made by :func:`enginekit.calibration.writers.write_qdq` keeps every node of the
float model under its own name, with its inputs rewired to DequantizeLinear outputs. Keeping a
node in float gives it back its float inputs: the activation tensors (still in the graph: a Q
reads them) and the float weights and bias of the source model (the Q/DQ model holds only
their int8 versions). Q/DQ nodes nobody reads any more are dropped. Nothing is re-quantized,
so one Q/DQ model yields every plan of the search in milliseconds.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import onnx

from enginekit.errors import CalibrationError

_QDQ = ("QuantizeLinear", "DequantizeLinear")


def quantized_nodes(qdq: onnx.ModelProto) -> list[str]:
    """Names of the compute nodes that read a DequantizeLinear output, in graph order: the
    layers that run in int8 (the candidates to keep in float)."""
    producer = {o: n for n in qdq.graph.node for o in n.output}
    out = []
    for node in qdq.graph.node:
        if node.op_type in _QDQ or not node.name:
            continue
        if any(getattr(producer.get(i), "op_type", "") == "DequantizeLinear" for i in node.input):
            out.append(node.name)
    return out


def keep_float(
    qdq: onnx.ModelProto, source: onnx.ModelProto, names: Iterable[str]
) -> onnx.ModelProto:
    """A copy of ``qdq`` where the nodes ``names`` read float inputs, as in ``source``.

    Raises:
        CalibrationError: a name that is no node of both models.
    """
    keep = set(names)
    if not keep:
        return qdq
    out = copy.deepcopy(qdq)
    graph = out.graph
    src_nodes = {n.name: n for n in source.graph.node if n.name}
    src_init = {t.name: t for t in source.graph.initializer}
    nodes = {n.name: n for n in graph.node if n.name}
    missing = sorted(n for n in keep if n not in nodes or n not in src_nodes)
    if missing:
        raise CalibrationError(
            f"layers {', '.join(missing[:5])} are not nodes of both the float and the Q/DQ "
            f"model; choose among quantized_nodes() of the Q/DQ model"
        )
    produced = {o for n in graph.node for o in n.output}
    present = {t.name for t in graph.initializer}
    src_producer = {o: n for n in source.graph.node for o in n.output}
    for name in keep:
        node, original = nodes[name], src_nodes[name]
        inputs = []
        for tensor in original.input:
            gone = src_producer.get(tensor)
            if gone is not None and gone.name not in nodes and tensor in produced:
                # ONNX Runtime's quantizer drops a Relu/Clip whose range the Q after the
                # layer before enforces, and gives that layer the activation's output name:
                # a float reader needs the activation back.
                inputs.append(_restore_activation(graph, gone, tensor, produced, src_init, present))
            elif tensor in src_init:
                # The Q/DQ model may reuse the name for the DequantizeLinear output (biases).
                float_name = tensor if tensor not in produced else f"{tensor}_float"
                if float_name not in present:
                    init = copy.deepcopy(src_init[tensor])
                    init.name = float_name
                    graph.initializer.append(init)
                    present.add(float_name)
                inputs.append(float_name)
            else:
                inputs.append(tensor)
        del node.input[:]
        node.input.extend(inputs)
    _drop_dead(out)
    return out


def _restore_activation(
    graph: onnx.GraphProto,
    activation: onnx.NodeProto,
    tensor: str,
    produced: set[str],
    src_init: dict[str, onnx.TensorProto],
    present: set[str],
) -> str:
    """A copy of ``activation`` (Relu/Clip) applied to the float ``tensor``, placed right after
    the node that makes ``tensor`` (nodes stay in topological order); its output name."""
    out = f"{tensor}_float"
    if out in produced:
        return out
    copied = copy.deepcopy(activation)
    copied.name = f"{activation.name or tensor}_float"
    copied.input[0] = tensor
    del copied.output[:]
    copied.output.append(out)
    for name in copied.input[1:]:
        if name in src_init and name not in present:
            graph.initializer.append(copy.deepcopy(src_init[name]))
            present.add(name)
    at = next(k for k, n in enumerate(graph.node) if tensor in n.output)
    graph.node.insert(at + 1, copied)
    produced.add(out)
    return out


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove Q/DQ nodes whose outputs nobody reads, then initializers nobody reads."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [
            n for n in graph.node
            if n.op_type in _QDQ and not any(o in read for o in n.output)
        ]  # fmt: skip
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input} | outputs
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
