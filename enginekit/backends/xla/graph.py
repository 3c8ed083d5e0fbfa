"""Graph preparation for the lowering: inlining, ordering (If branches' outer reads counted),
and the ONNX-level weight rewrites done before tracing."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from enginekit.backends.xla.check import attributes, subgraphs
from enginekit.errors import BuildError


def prepare(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its local functions inlined (torch's exporter may emit them)."""
    if proto.functions:
        from onnx import inliner

        return inliner.inline_local_functions(proto)
    return proto


def outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads from the scope around it."""
    own = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    own |= {o for n in graph.node for o in n.output}
    return {name for n in graph.node for name in uses(n)} - own


def uses(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads: its inputs, and what its subgraphs take from outside."""
    implicit = sorted({name for g in subgraphs(node) for name in outer_names(g)})
    return [*node.input, *implicit]


def topological(
    graph: onnx.GraphProto, outer: frozenset[str] = frozenset()
) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before use.

    Args:
        outer: names a subgraph may read from the scope around it.

    Raises:
        BuildError: a cycle, or an input nothing produces.
    """
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""} | outer
    pending = list(graph.node)
    needs = {id(n): uses(n) for n in pending}
    ordered: list[onnx.NodeProto] = []
    while pending:
        ready = [n for n in pending if all(i in known for i in needs[id(n)])]
        if not ready:
            missing = sorted({i for n in pending for i in needs[id(n)] if i not in known})
            raise BuildError(
                f"the graph cannot be ordered: tensor(s) {', '.join(missing[:5])} are used but "
                "never produced (a cycle, or a subgraph-only value)"
            )
        ready_ids = {id(n) for n in ready}
        ordered.extend(ready)
        for n in ready:
            known.update(n.output)
        pending = [n for n in pending if id(n) not in ready_ids]
    return ordered


def pretransposed_gemms(
    nodes: list[onnx.NodeProto], consts: dict[str, np.ndarray], outputs: set[str]
) -> list[onnx.NodeProto]:
    """Gemm with ``transB=1`` on a constant B read by nothing else: B stored transposed and
    ``transB=0``. XLA:CPU's dot takes B as [K, N]; given [N, K] it copies the whole weight into
    that layout on every call (a classifier's 2 MB ``transpose_copy_fusion`` per inference)."""
    readers: dict[str, int] = {}
    for node in nodes:
        for name in uses(node):
            readers[name] = readers.get(name, 0) + 1
    out = []
    for node in nodes:
        b = node.input[1] if node.op_type == "Gemm" and len(node.input) > 1 else ""
        alone = readers.get(b) == 1 and b not in outputs
        if b in consts and alone and attributes(node).get("transB", 0):
            consts[b] = np.ascontiguousarray(consts[b].T)
            node = _with_attr(node, "transB", 0)
        out.append(node)
    return out


def _with_attr(node: onnx.NodeProto, name: str, value: Any) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    kept = [a for a in copy.attribute if a.name != name]
    del copy.attribute[:]
    copy.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])
    return copy
