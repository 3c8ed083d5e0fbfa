"""Walking ONNX graphs: node labels, subgraphs, what a node reads, a topological order.

Backend-neutral (the XLA lowering and every backend's value-input detection,
:mod:`enginekit.backends.values`, walk graphs the same way); reads only ``onnx`` protos.
"""

from __future__ import annotations

import onnx

from enginekit.errors import BuildError


def node_label(node: onnx.NodeProto, index: int) -> str:
    """``name (Op)``, or ``#index (Op)`` for an unnamed node: how errors name a node."""
    return f"{node.name or f'#{index}'} ({node.op_type})"


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes (If's branches, Loop's body)."""
    found: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


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
