"""Graph-level passes: simplification (onnxslim), shape inference, subgraphs, renaming."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import onnx

from enginekit.errors import ModelError, closest
from enginekit.model import ModelSource, io_specs, load_model

log = logging.getLogger("enginekit.passes")

SIMPLIFY_STEPS = (
    "constant_folding",
    "dead_node_elimination",
    "subexpression_elimination",
    "graph_fusion",
    "weight_tying",
    "shape_inference",
)
# onnxslim keeps its settings in class attributes: one simplification at a time.
_SLIM_LOCK = threading.Lock()


def count_nodes(proto: onnx.ModelProto) -> int:
    """Number of nodes in the main graph."""
    return len(proto.graph.node)


def _copy(source: ModelSource) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    proto.CopyFrom(load_model(source).proto)
    return proto


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph (If/Loop/Scan bodies) inside it, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


# -- simplification ----------------------------------------------------------------------------


#: Models whose serialized size onnx.checker can take (protobuf's 2 GB limit), with a margin.
_CHECKABLE = 1 << 30


def simplify(source: ModelSource) -> onnx.ModelProto:
    """Fold constants, remove dead nodes, merge common subexpressions and infer shapes (onnxslim).

    Only standard-domain ops come out; inputs and outputs keep their names, dtypes and ranks.

    Raises:
        ModelError: onnxslim is not installed, fails on the model, leaves a model the ONNX checker
            rejects, or changed its inputs/outputs.
    """
    try:
        import onnxslim
    except ImportError:
        raise ModelError(
            "graph simplification needs onnxslim (pip install onnxslim); or skip it with "
            "simplify=False (CLI: --no-simplify)"
        ) from None
    proto = _copy(source)  # onnxslim edits the model it is given
    before = _io_signature(proto)
    try:
        with _SLIM_LOCK:
            out = onnxslim.slim(proto)
    except Exception as exc:
        raise ModelError(
            f"onnxslim failed on the model ({type(exc).__name__}: {exc}); build with "
            "simplify=False (CLI: --no-simplify)"
        ) from None
    if not isinstance(out, onnx.ModelProto):
        raise ModelError("onnxslim returned no model; build with simplify=False (--no-simplify)")
    if out.ByteSize() < _CHECKABLE:  # the checker takes protos under 2 GB only
        try:
            onnx.checker.check_model(out)
        except Exception as exc:  # e.g. a subgraph's outer-scope name folded away
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(
                f"onnxslim left an invalid model ({first}); build with simplify=False "
                "(CLI: --no-simplify)"
            ) from None
    after = _io_signature(out)
    if after != before:
        raise ModelError(
            f"onnxslim changed the model's inputs/outputs from {before} to {after}; build with "
            "simplify=False (CLI: --no-simplify)"
        )
    return out


def _io_signature(proto: onnx.ModelProto) -> tuple[tuple[tuple[str, str, int], ...], ...]:
    inputs, outputs = io_specs(proto)
    return tuple(
        tuple((s.name, s.dtype, len(s.shape)) for s in group) for group in (inputs, outputs)
    )


def infer_shapes(source: ModelSource) -> onnx.ModelProto:
    """The model with ONNX shape inference's value_info filled in (lenient: never raises on
    a node it cannot infer)."""
    proto = _copy(source)
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
    except Exception as exc:  # models over 2 GiB, unknown custom ops
        log.info("shape inference failed (%s); continuing without it", exc)
        return proto


# -- subgraphs and renaming --------------------------------------------------------------------


def _tensor_names(proto: onnx.ModelProto) -> set[str]:
    names = {v.name for v in proto.graph.input} | {t.name for t in proto.graph.initializer}
    return names | {o for n in proto.graph.node for o in n.output if o}


def _unknown(kind: str, name: str, known: set[str]) -> ModelError:
    close = closest(name, known, n=3)
    if close:
        hint = f" (did you mean {', '.join(map(repr, close))}?)"
    else:  # nothing alike: show some names to pick from
        some = sorted(known)
        more = (
            f", ... ({len(some)} in all; `enginekit inspect` lists them)" if len(some) > 12 else ""
        )
        hint = f" (its tensors: {', '.join(map(repr, some[:12]))}{more})"
    return ModelError(f"{kind} {name!r} is not a tensor of the model{hint}")


def extract(
    source: ModelSource, outputs: Sequence[str], inputs: Sequence[str] | None = None
) -> onnx.ModelProto:
    """The subgraph computing ``outputs`` (any tensor names, intermediate ones included) from
    ``inputs`` (default: those of the model's inputs that the outputs need).

    Raises:
        ModelError: a name is not a tensor of the model, or an output's type cannot be inferred.
    """
    if not outputs:
        raise ModelError("extract: give at least one output name")
    proto = infer_shapes(source)
    known = _tensor_names(proto)
    for name in list(outputs) + list(inputs or []):
        if name not in known:
            raise _unknown("output" if name in outputs else "input", name, known)
    init = {t.name for t in proto.graph.initializer}
    graph_inputs = [v.name for v in proto.graph.input if v.name not in init]
    stop = set(inputs) if inputs is not None else set(graph_inputs)
    producer = {o: n for n in proto.graph.node for o in n.output if o}
    needed: list[str] = []
    stack, seen = list(outputs), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in stop:
            needed.append(name)
        elif name in producer:
            stack.extend(i for i in producer[name].input if i)
            for g in _node_subgraphs(producer[name]):  # outer-scope names used by subgraphs
                stack.extend(_outer_names(g))
    order = list(inputs) if inputs is not None else graph_inputs
    chosen = [n for n in order if n in needed]
    typed = {v.name for v in list(proto.graph.value_info) + list(proto.graph.input)}
    typed |= {v.name for v in proto.graph.output}
    for name in outputs:
        if name not in typed and name not in init:
            raise ModelError(
                f"extract: shape inference could not find the type of tensor {name!r}; "
                "pick a tensor closer to the inputs, or run the model through onnxslim first"
            )
    try:
        out = onnx.utils.Extractor(proto).extract_model(chosen, list(outputs))
    except Exception as exc:
        raise ModelError(f"extract {list(outputs)}: {exc}") from None
    out.ir_version = proto.ir_version
    del out.opset_import[:]
    out.opset_import.extend(proto.opset_import)
    return out


def _node_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    local |= {o for n in graph.node for o in n.output}
    used = {i for g in _graphs(graph) for n in g.node for i in n.input if i}
    return used - local


def rename(source: ModelSource, names: Mapping[str, str]) -> onnx.ModelProto:
    """The model with inputs/outputs renamed (``{"old": "new"}``); every use follows.

    Raises:
        ModelError: an old name is not an input or output, or a new name is already taken.
    """
    proto = _copy(source)
    io = {v.name for v in proto.graph.input} | {v.name for v in proto.graph.output}
    taken = _tensor_names(proto)
    for old, new in names.items():
        if old not in io:
            raise _unknown("input/output", old, io)
        if new in taken and new != old:
            raise ModelError(f"rename {old!r} -> {new!r}: the model already has a tensor {new!r}")

    def swap(seq: Any) -> None:
        for i, n in enumerate(seq):
            if n in names:
                seq[i] = names[n]

    for g in _graphs(proto.graph):
        for node in g.node:
            swap(node.input)
            swap(node.output)
        for v in list(g.input) + list(g.output) + list(g.value_info):
            v.name = names.get(v.name, v.name)
        for t in g.initializer:
            t.name = names.get(t.name, t.name)
    return proto
