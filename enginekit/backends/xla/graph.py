"""Graph preparation for the lowering: inlining, ordering (If branches' outer reads counted),
and the ONNX-level weight rewrites done before tracing."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from enginekit.backends.xla.nodes import attributes, uses


def prepare(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its local functions inlined (torch's exporter may emit them)."""
    if proto.functions:
        from onnx import inliner

        return inliner.inline_local_functions(proto)
    return proto


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
