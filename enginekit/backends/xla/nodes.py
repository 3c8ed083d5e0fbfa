"""Reading ONNX nodes and graphs for the lowering: attributes as Python values, labels,
subgraphs, outer reads and a topological order (the graph walking lives in
:mod:`enginekit.passes.nodes`, shared with the other backends; re-exported here).

A leaf module: the checker, the graph preparation, the lowering and the op functions that walk
subgraphs (Loop, Scan) all read nodes the same way, without importing one another.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import numpy_helper

from enginekit.passes.nodes import node_label, outer_names, subgraphs, topological, uses

__all__ = [
    "IGNORED_ATTRS",
    "attributes",
    "node_label",
    "outer_names",
    "subgraphs",
    "topological",
    "uses",
]

#: Attributes old opsets carry that change nothing at inference time.
IGNORED_ATTRS = frozenset({"consumed_inputs"})


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values (strings decoded, tensors as numpy)."""
    out: dict[str, Any] = {}
    for attr in node.attribute:
        if attr.name in IGNORED_ATTRS:
            continue
        if attr.type == onnx.AttributeProto.TENSOR:
            out[attr.name] = numpy_helper.to_array(attr.t)
            continue
        if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
            out[attr.name] = attr.sparse_tensor
            continue
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode("utf-8") for v in value]
        out[attr.name] = value
    return out
