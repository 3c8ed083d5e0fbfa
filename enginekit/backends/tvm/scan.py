"""ONNX ``Scan`` (opset 9 on) unrolled into its body's ops before import: TVM 0.27's Relax
importer has no Scan converter, and the standard's ``LinearAttention`` (and other recurrent
function bodies) are written with one.

Each step is a copy of the body wired to the previous step's states and to the step's slice of
every scan input (a ``Gather`` at that index); scan outputs are ``Unsqueeze``d and concatenated.
This needs every scan input's length along its scan axis known from shape inference; a Scan
whose length is not (or opset 8's batched Scan) is left as it is, and the op check then names it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Longest sequence unrolled: each step copies the body.
MAX_STEPS = 256


def _attr(node: Any, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _produced(graph: Any) -> set[str]:
    """Names a graph defines: its inputs, initializers and every node output, nested included."""
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                names |= _produced(g)
    return names


def _length(types: dict[str, Any], name: str, axis: int) -> int | None:
    """The static size of ``name`` along ``axis`` (shape inference's), else None."""
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    if not -len(dims) <= axis < len(dims):
        return None
    dim = dims[axis]
    return int(dim.dim_value) if dim.HasField("dim_value") else None


def unroll_scans(proto: Any) -> tuple[Any, list[str]]:
    """``proto`` with every top-level Scan of a known, static length unrolled.

    Returns:
        (the model, or ``proto`` itself when nothing was unrolled; the Scan nodes unrolled).
    """
    import onnx

    from enginekit.backends.tvm.expand import _opset, _types

    opset = _opset(proto, "") or 0
    if opset < 9 or not any(n.op_type == "Scan" for n in proto.graph.node):
        return proto, []
    types = _types(proto)
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    new: list[Any] = []
    inits: list[Any] = []
    done: list[str] = []
    for index, node in enumerate(proto.graph.node):
        steps = _unrolled(node, index, types, opset, inits) if node.op_type == "Scan" else None
        if steps is None:
            new.append(node)
            continue
        done.append(node.name or node.output[0])
        new.extend(steps)
    if not done:
        return proto, []
    del out.graph.node[:]
    out.graph.node.extend(new)
    out.graph.initializer.extend(inits)
    log.info("tvm: unrolled Scan nodes %s", ", ".join(done))
    return out, done


def _unrolled(
    node: Any, index: int, types: dict[str, Any], opset: int, inits: list[Any]
) -> list[Any] | None:
    """The nodes replacing one Scan node, or None when it stays (length unknown or too long)."""
    import numpy as np
    from onnx import helper, numpy_helper

    body = _attr(node, "body", None)
    m = int(_attr(node, "num_scan_inputs", 0))
    n = len(node.input) - m
    k = len(body.output) - n
    in_axes = list(_attr(node, "scan_input_axes", [0] * m))
    in_dirs = list(_attr(node, "scan_input_directions", [0] * m))
    out_axes = list(_attr(node, "scan_output_axes", [0] * k))
    out_dirs = list(_attr(node, "scan_output_directions", [0] * k))
    lengths = {_length(types, node.input[n + j], in_axes[j]) for j in range(m)}
    seq = lengths.pop() if len(lengths) == 1 else None
    if seq is None or not 1 <= seq <= MAX_STEPS:
        return None
    tag = f"enginekit_scan{index}_"
    local = _produced(body)
    shared = hoist_initializers(body, tag, inits)
    nodes: list[Any] = []
    for t in range(seq):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"{tag}i{t}"))
    states = list(node.input[:n])
    slices: list[list[str]] = [[] for _ in range(k)]
    for t in range(seq):
        names: dict[str, str] = {body.input[i].name: states[i] for i in range(n)}
        for j in range(m):
            at = seq - 1 - t if in_dirs[j] else t
            sliced = f"{tag}t{t}_in{j}"
            nodes.append(
                helper.make_node(
                    "Gather", [node.input[n + j], f"{tag}i{at}"], [sliced], axis=in_axes[j]
                )
            )
            names[body.input[n + j].name] = sliced
        resolved = unroll_step(body, names, shared, local, f"{tag}t{t}_", nodes)
        states = resolved[:n]
        for j in range(k):
            slices[j].append(resolved[n + j])
    for i in range(n):
        if node.output[i]:
            nodes.append(helper.make_node("Identity", [states[i]], [node.output[i]]))
    for j in range(k):
        target = node.output[n + j] if n + j < len(node.output) else ""
        if not target:
            continue
        parts = slices[j][::-1] if out_dirs[j] else slices[j]
        axis = int(out_axes[j])
        grown = []
        for t, name in enumerate(parts):
            g = f"{tag}out{j}_{t}"
            if opset >= 13:
                axes = f"{tag}axes{j}"
                if t == 0:
                    inits.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
                nodes.append(helper.make_node("Unsqueeze", [name, axes], [g]))
            else:
                nodes.append(helper.make_node("Unsqueeze", [name], [g], axes=[axis]))
            grown.append(g)
        nodes.append(helper.make_node("Concat", grown, [target], axis=axis))
    return nodes


def _renamer(
    names: dict[str, str], shared: dict[str, str], local: set[str], prefix: str
) -> Callable[[str], str]:
    """Body names to this step's: inputs to their values, body initializers to their shared
    copies, the body's own values prefixed, outer-scope names unchanged."""

    def rename(name: str) -> str:
        if not name:
            return ""
        if name in names:
            return names[name]
        if name in shared:
            return shared[name]
        return prefix + name if name in local else name

    return rename


def hoist_initializers(body: Any, tag: str, inits: list[Any]) -> dict[str, str]:
    """Copy a loop body's initializers into the outer graph once, under ``tag``-prefixed names
    (appended to ``inits``); returns body name -> shared name for :func:`_renamer`."""
    import onnx

    shared = {t.name: tag + "init_" + t.name for t in body.initializer}
    for t in body.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        copy.name = shared[t.name]
        inits.append(copy)
    return shared


def unroll_step(
    body: Any, names: dict[str, str], shared: dict[str, str], local: set[str], prefix: str,
    nodes: list[Any],
) -> list[str]:  # fmt: skip
    """One step of an unrolled loop: the body's nodes renamed for it (``names``: its inputs'
    values this step) appended to ``nodes``; returns the names of the body's outputs."""
    from enginekit.backends.tvm.expand import _renamed

    rename = _renamer(names, shared, local, prefix)
    for b in body.node:
        copy = _renamed(b, rename, {})
        copy.name = f"{prefix}{b.name or b.output[0]}"
        nodes.append(copy)
    return [rename(o.name) for o in body.output]
