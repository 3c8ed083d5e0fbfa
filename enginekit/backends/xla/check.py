"""Whether the lowering can take a model: ops, domains, attribute names, value types.

Runs before anything is traced or compiled, and reports every offending node at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import onnx

from enginekit.backends.xla.nodes import IGNORED_ATTRS, node_label, subgraphs
from enginekit.errors import BuildError

DEFAULT_DOMAINS = ("", "ai.onnx")
#: Binary ops whose opset < 7 forms carry ``broadcast``/``axis`` attributes.
LEGACY_BINARY = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Less", "Greater"}
)


def opset_of(proto: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return next((o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS), 1)


def _accepted_attrs(fn: Callable[..., Any]) -> set[str] | None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind != p.VAR_POSITIONAL} - {"channels_last", "run"}


def _takes_branches(fn: Callable[..., Any]) -> bool:
    """Whether the op function lowers subgraphs (If): it has a ``run`` parameter."""
    return "run" in inspect.signature(fn).parameters


def _type_problem(value: onnx.ValueInfoProto) -> str | None:
    from enginekit.backends.xla.ops.common import UNSUPPORTED_TYPES

    kind = value.type.WhichOneof("value")
    if kind not in (None, "tensor_type"):
        return f"a {kind.replace('_type', '')} value; only tensors are supported"
    elem = value.type.tensor_type.elem_type
    if kind and elem in UNSUPPORTED_TYPES:
        name = onnx.TensorProto.DataType.Name(elem)
        return f"type {name} (string, float8, float4, int4 and int2 tensors are not supported)"
    return None


def problems(proto: onnx.ModelProto) -> list[str]:
    """Why the lowering cannot take each node it cannot take (empty: it takes them all)."""

    opset = opset_of(proto)
    found = [
        f"{kind} {v.name!r}: {_type_problem(v)}"
        for kind, values in (("input", proto.graph.input), ("output", proto.graph.output))
        for v in values
        if _type_problem(v)
    ]
    found.extend(_node_problems(list(proto.graph.node), opset))
    return found


def _node_problems(nodes: list[onnx.NodeProto], opset: int) -> list[str]:
    from enginekit.backends.xla.ops import resolve

    found = []
    for i, node in enumerate(nodes):
        label = node_label(node, i)
        if node.domain not in DEFAULT_DOMAINS:
            found.append(
                f"node {label}: op {node.domain}::{node.op_type} (only the default ONNX domain is supported)"
            )
            continue
        fn = resolve(node.op_type, opset)
        if fn is None:
            found.append(f"node {label}: op {node.op_type} is not supported")
            continue
        branches = subgraphs(node)
        if branches and not _takes_branches(fn):
            found.append(f"node {label}: subgraph attributes are not supported")
            continue
        for graph in branches:
            found.extend(
                f"{label} branch {graph.name!r}: {p}"
                for p in _node_problems(list(graph.node), opset)
            )
        accepted = _accepted_attrs(fn)
        legacy = {"broadcast", "axis"} if opset < 7 and node.op_type in LEGACY_BINARY else set()
        unknown = sorted(
            {a.name for a in node.attribute} - IGNORED_ATTRS - legacy - (accepted or set())
        )
        if accepted is not None and unknown:
            found.append(f"node {label}: attribute(s) {', '.join(unknown)} not supported")
    return found


def check(proto: onnx.ModelProto) -> None:
    """Refuse, before any tracing or compiling, a model with an op the lowering lacks.

    Raises:
        BuildError: naming every unsupported op and the node using it.
    """
    found = problems(proto)
    if found:
        shown = "; ".join(found[:20]) + (f"; and {len(found) - 20} more" if len(found) > 20 else "")
        raise BuildError(
            f"the XLA backend cannot lower this model: {shown}. `enginekit backends` lists the "
            "supported ops; use another backend (e.g. --backend onnxruntime) for this model"
        )
