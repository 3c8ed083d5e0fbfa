"""ONNX graph preparation: simplification, opset conversion, subgraphs, renaming, dynamic batch.

:func:`prepare` is what ``build`` runs between loading the user's model and handing it to a
backend. Every pass it runs is recorded (name, node counts, seconds) in the artifact's manifest;
the build's source hash and its verification reference stay the user's own model.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.errors import BuildError, ModelError
from enginekit.model import (
    Model,
    ModelSource,
    concrete_shapes,
    io_specs,
    load_model,
    random_feeds,
    reference_session,
)

log = logging.getLogger(__name__)

#: What ``simplify`` runs, in onnxslim's terms (recorded in the manifest).
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


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What one graph pass did, as ``manifest["passes"]`` records it."""

    name: str
    nodes_before: int
    nodes_after: int
    seconds: float
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": round(self.seconds, 4),
            **self.detail,
        }


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The result of :func:`prepare`.

    Attributes:
        reference: what verification compares against: the user's model (its subgraph when
            ``outputs`` were selected), untouched by simplification or opset conversion.
        model: what the backend builds.
        passes: every pass that ran, in order.
    """

    reference: Model
    model: Model
    passes: tuple[PassRecord, ...]


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


def simplify(source: ModelSource) -> onnx.ModelProto:
    """Fold constants, remove dead nodes, merge common subexpressions and infer shapes (onnxslim).

    Only standard-domain ops come out; inputs and outputs keep their names, dtypes and ranks.

    Raises:
        ModelError: onnxslim is not installed, fails on the model, or changed its inputs/outputs.
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


# -- opset conversion --------------------------------------------------------------------------


def _has_schema(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def convert_opset(source: ModelSource, opset: int) -> onnx.ModelProto:
    """The model converted to ai.onnx ``opset`` with ``onnx.version_converter``.

    The converter lacks many downgrade adapters for ops whose newer version only widened the
    types it accepts (Add 14 -> 13, Identity 16 -> 14). Such an op, when its inputs, outputs
    and attributes are the same at both versions, is carried over unchanged and its types are
    then checked against the older schema; the op list is recorded as ``carried``.

    Raises:
        ModelError: naming the model's opset, the target, and the op that cannot be converted.
    """
    return _convert(_copy(source), opset)[0]


def _convert(proto: onnx.ModelProto, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    current = _opset(proto)
    if current == opset:
        return proto, []
    newest = onnx.defs.onnx_opset_version()
    if not 1 <= opset <= newest:
        raise ModelError(
            f"cannot convert the model from opset {current} to {opset}: onnx {onnx.__version__} "
            f"knows opsets 1..{newest}"
        )
    ops = {n.op_type for g in _graphs(proto.graph) for n in g.node if n.domain in ("", "ai.onnx")}
    missing = sorted(op for op in ops if not _has_schema(op, opset))
    if missing:
        raise ModelError(
            f"cannot convert the model from opset {current} to {opset}: op(s) "
            f"{', '.join(missing)} do not exist at opset {opset}. Export the model at opset "
            f"{opset} or lower from its framework, or use a backend that accepts opset {current}"
        )
    carried: list[str] = []
    while True:
        try:
            out = onnx.version_converter.convert_version(_hide(proto, carried), opset)
            break
        except Exception as exc:
            text = " ".join(str(exc).split())
            found = re.search(r"No Adapter (?:From|To) Version \$\d+ for (\w+)", text)
            op = found.group(1) if found else None
            if op and op not in carried and _same_signature(op, current, opset):
                carried.append(op)
                continue
            culprit = op or next((o for o in sorted(ops) if re.search(rf"\b{o}\b", text)), None)
            which = f": op {culprit!r} has no conversion" if culprit else ""
            raise ModelError(
                f"cannot convert the model from opset {current} to {opset}{which} ({text}). "
                f"Export the model at opset {opset} from its framework instead"
            ) from None
    out = _unhide(out, carried)
    if carried:
        _check_types(out, carried, current, opset)
    # Never lower the IR version (the model may use newer IR features); raise it if needed.
    needed = onnx.helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
    out.ir_version = max(proto.ir_version, needed)
    return out, carried


_CARRY = "enginekit.carry"  # a private domain the converter leaves alone


def _same_signature(op: str, a: int, b: int) -> bool:
    def formals(s: Any) -> tuple[Any, ...]:
        return (
            [(f.name, f.option) for f in s.inputs],
            [(f.name, f.option) for f in s.outputs],
            sorted((k, v.type) for k, v in s.attributes.items()),
        )

    return formals(onnx.defs.get_schema(op, a, "")) == formals(onnx.defs.get_schema(op, b, ""))


def _hide(proto: onnx.ModelProto, ops: Sequence[str]) -> onnx.ModelProto:
    if not ops:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for g in _graphs(out.graph):
        for n in g.node:
            if n.domain in ("", "ai.onnx") and n.op_type in ops:
                n.domain = _CARRY
    out.opset_import.append(onnx.helper.make_opsetid(_CARRY, 1))
    return out


def _unhide(proto: onnx.ModelProto, ops: Sequence[str]) -> onnx.ModelProto:
    if not ops:
        return proto
    for g in _graphs(proto.graph):
        for n in g.node:
            if n.domain == _CARRY:
                n.domain = ""
    keep = [o for o in proto.opset_import if o.domain != _CARRY]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    return proto


def _check_types(proto: onnx.ModelProto, carried: Sequence[str], current: int, opset: int) -> None:
    """Type-check carried ops against their older schema (e.g. bfloat16 Add is not opset 13)."""
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as exc:
        text = " ".join(str(exc).split())
        op = next((o for o in carried if re.search(rf"\b{o}\b", text)), None)
        if op is not None:
            raise ModelError(
                f"cannot convert the model from opset {current} to {opset}: op {op!r} uses "
                f"types its opset-{opset} version does not accept ({text})"
            ) from None
        log.info("type check after opset conversion inconclusive: %s", text)


# -- subgraphs and renaming --------------------------------------------------------------------


def _tensor_names(proto: onnx.ModelProto) -> set[str]:
    names = {v.name for v in proto.graph.input} | {t.name for t in proto.graph.initializer}
    return names | {o for n in proto.graph.node for o in n.output if o}


def _unknown(kind: str, name: str, known: set[str]) -> ModelError:
    close = difflib.get_close_matches(name, sorted(known), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
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


_simplify = simplify  # prepare()'s keyword argument shadows the function's name


# -- the build's pipeline ----------------------------------------------------------------------


def _timed(
    name: str, fn: Callable[..., onnx.ModelProto], model: Model, *args: Any, **detail: Any
) -> tuple[Model, PassRecord]:
    start = time.perf_counter()
    proto = fn(model.proto, *args)
    seconds = time.perf_counter() - start
    out = load_model(proto)
    return out, PassRecord(name, count_nodes(model.proto), count_nodes(proto), seconds, detail)


def _slim_version() -> str:
    try:
        import onnxslim

        return f"onnxslim {onnxslim.__version__}"
    except ImportError:
        return "onnxslim (not installed)"


def prepare(
    model: Model,
    *,
    simplify: bool = True,
    outputs: Sequence[str] = (),
    opsets: tuple[int, int] | None = None,
) -> Prepared:
    """The graph passes of a build: subgraph selection, simplification, opset conversion.

    Simplification runs before the opset conversion: fewer ops reach onnx's version converter,
    whose downgrade adapters are incomplete (e.g. none for Identity from opset 16 down).

    Args:
        model: the user's model, as loaded.
        simplify: run :func:`simplify`; a failure there is logged and recorded, not raised
            (the unsimplified model is built instead).
        outputs: build only the subgraph computing these tensors (for debugging a mismatch).
        opsets: (min, max) ai.onnx opsets the backend accepts; the model is converted to the
            nearest one when outside.

    Raises:
        BuildError: a selected output does not exist, or the opset conversion is impossible.
    """
    records: list[PassRecord] = []
    reference = model
    if outputs:
        try:
            reference, rec = _timed("extract", extract, model, list(outputs))
        except ModelError as exc:
            raise BuildError(f"outputs={list(outputs)}: {exc}") from None
        records.append(dataclasses.replace(rec, detail={"outputs": list(outputs)}))
    current = reference
    if simplify:
        detail = {"tool": _slim_version(), "steps": list(SIMPLIFY_STEPS)}
        start = time.perf_counter()
        try:
            current, rec = _timed("simplify", _simplify, current, **detail)
        except ModelError as exc:
            log.warning("graph simplification skipped: %s", exc)
            n = count_nodes(current.proto)
            rec = PassRecord(
                "simplify", n, n, time.perf_counter() - start, {**detail, "error": str(exc)}
            )
        records.append(rec)
    if opsets is not None and not opsets[0] <= current.opset <= opsets[1]:
        target = min(max(current.opset, opsets[0]), opsets[1])
        try:
            start = time.perf_counter()
            proto, carried = _convert(_copy(current), target)
        except ModelError as exc:
            raise BuildError(
                f"{exc}; the backend accepts opsets {opsets[0]}..{opsets[1]}"
            ) from None
        conversion: dict[str, Any] = {"from": current.opset, "to": target, "carried": carried}
        rec = PassRecord("convert_opset", count_nodes(current.proto), count_nodes(proto),
                         time.perf_counter() - start, conversion)  # fmt: skip
        current = load_model(proto)
        records.append(rec)
    for rec in records:
        log.info("pass %s: %d -> %d nodes in %.3f s", rec.name, rec.nodes_before,
                 rec.nodes_after, rec.seconds)  # fmt: skip
    return Prepared(reference, current, tuple(records))


# -- dynamic batch ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchRewrite:
    """What :func:`rewrite_batch` did.

    Attributes:
        model: the rewritten model.
        batch: the fixed batch size found on the inputs (None: it was dynamic already).
        rewritten: one line per change made.
        unproven: one line per constant that may hold the batch size but could not be proven
            to; check the model with :func:`lint_batch` and fix these by hand if it fails.
    """

    model: onnx.ModelProto
    batch: int | None
    rewritten: tuple[str, ...]
    unproven: tuple[str, ...]


def _drop_initializer_inputs(proto: onnx.ModelProto) -> int:
    """Remove initializers from the graph inputs (old exporters list them there, which makes
    them overridable inputs: nothing that depends on them can be folded or proven constant)."""
    init = {t.name for t in proto.graph.initializer}
    keep = [v for v in proto.graph.input if v.name not in init]
    dropped = len(proto.graph.input) - len(keep)
    if dropped:
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
        proto.ir_version = max(proto.ir_version, 4)  # IR < 4 requires initializers as inputs
    return dropped


def _fixed_batch(proto: onnx.ModelProto) -> int | None:
    sizes = set()
    for v in proto.graph.input:
        dims = v.type.tensor_type.shape.dim
        if not dims:
            raise ModelError(f"input {v.name!r} is a scalar; it has no batch dim to make dynamic")
        if dims[0].HasField("dim_value"):
            sizes.add(dims[0].dim_value)
    if len(sizes) > 1:
        raise ModelError(
            f"inputs disagree on their leading dim ({sorted(sizes)}); no single batch dim"
        )
    return sizes.pop() if sizes else None


def _constants(
    proto: onnx.ModelProto,
) -> dict[str, tuple[np.ndarray, Callable[[np.ndarray], None]]]:
    """Constant tensors by name: their value and a setter that rewrites them in place."""
    found: dict[str, tuple[np.ndarray, Callable[[np.ndarray], None]]] = {}
    for t in proto.graph.initializer:

        def set_init(v: np.ndarray, t: onnx.TensorProto = t) -> None:
            t.CopyFrom(numpy_helper.from_array(v.astype(numpy_helper.to_array(t).dtype), t.name))

        found[t.name] = (numpy_helper.to_array(t), set_init)
    for node in proto.graph.node:
        if node.op_type != "Constant" or not node.output:
            continue
        for attr in node.attribute:
            if attr.name == "value":

                def set_t(v: np.ndarray, a: onnx.AttributeProto = attr) -> None:
                    a.t.CopyFrom(
                        numpy_helper.from_array(v.astype(numpy_helper.to_array(a.t).dtype))
                    )

                found[node.output[0]] = (numpy_helper.to_array(attr.t), set_t)
            elif attr.name == "value_ints":

                def set_ints(v: np.ndarray, a: onnx.AttributeProto = attr) -> None:
                    del a.ints[:]
                    a.ints.extend(int(x) for x in v)

                found[node.output[0]] = (np.array(attr.ints, np.int64), set_ints)
    return found


def _inferred_dims(proto: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    inferred = infer_shapes(proto)
    dims: dict[str, tuple[int | str | None, ...]] = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input):
        t = v.type.tensor_type
        if t.HasField("shape"):
            dims[v.name] = tuple(
                d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                for d in t.shape.dim
            )
    return dims


def _shared_constant(proto: onnx.ModelProto, name: str) -> bool:
    return sum(i == name for n in proto.graph.node for i in n.input) > 1


def _rewrite_round(
    proto: onnx.ModelProto, batch: int, sym: str, done: set[str]
) -> tuple[list[str], list[str]]:
    """One pass over the nodes: rewrite what shape inference proves, report what it cannot."""
    dims = _inferred_dims(proto)
    consts = _constants(proto)
    rewritten: list[str] = []
    unproven: list[str] = []
    for node in proto.graph.node:
        label = f"{node.op_type} {node.name or node.output[0]!r}"
        if label in done:
            continue
        src = dims.get(node.input[0]) if node.input else None
        if node.op_type == "Flatten":
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            if axis == 0 and batch == 1 and src and src[0] == sym:
                # At batch 1, Flatten(axis=0) == Flatten(axis=1); only axis=1 follows the batch.
                for a in node.attribute:
                    if a.name == "axis":
                        a.i = 1
                rewritten.append(f"{label}: axis 0 -> 1")
                done.add(label)
            continue
        shape_input = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0}.get(node.op_type)
        if shape_input is None or len(node.input) <= shape_input:
            continue
        const = consts.get(node.input[shape_input])
        if const is None:
            continue
        values, setter = const
        if values.ndim != 1 or not len(values) or values[0] != batch:
            continue
        if node.op_type == "Expand" and src and src[0] == sym:
            continue  # broadcasting already carries the batch through a leading 1
        if node.op_type == "Reshape":
            allowzero = any(a.name == "allowzero" and a.i == 1 for a in node.attribute)
            new = _reshape_batch(values, src, sym, allowzero)
            if new is not None:
                if _shared_constant(proto, node.input[1]):
                    fresh = f"{node.input[1]}__batch_dynamic"
                    proto.graph.initializer.append(numpy_helper.from_array(new, fresh))
                    node.input[1] = fresh
                else:
                    setter(new)
                rewritten.append(f"{label}: shape {values.tolist()} -> {new.tolist()}")
                done.add(label)
                continue
        if node.op_type == "ConstantOfShape":
            src = None  # its input is the shape itself; there is no data input to trace
        unproven.append(
            f"{label}: constant shape {values.tolist()} starts with the batch size {batch}, but "
            f"nothing proves it is the batch (data input shape: {src or 'unknown'})"
        )
    return rewritten, unproven


def _reshape_batch(
    values: np.ndarray, src: tuple[Any, ...] | None, sym: str, allowzero: bool
) -> np.ndarray | None:
    """The shape constant with the batch made dynamic, or None when that cannot be proven."""
    if not src:
        return None
    new = values.astype(np.int64).copy()
    if src[0] == sym and not allowzero:
        new[0] = 0  # copy the input's dim 0, which is the batch
        return new
    # The input holds the batch once and otherwise fixed dims: its size is batch * K, and the
    # other entries fix K, so -1 recovers the batch.
    if (
        sum(d == sym for d in src) == 1
        and all(isinstance(d, int) for d in src if d != sym)
        and -1 not in values[1:].tolist()
        and (allowzero or 0 not in values[1:].tolist())
    ):
        new[0] = -1
        return new
    return None


def rewrite_batch(source: ModelSource, name: str = "batch") -> BatchRewrite:
    """Make a fixed leading batch dim symbolic, and fix the constants that bake it in.

    Handles models from old exporters: initializers listed as graph inputs are removed from
    the inputs; Reshape shape constants (initializers or Constant nodes) whose first entry is
    the batch are rewritten where shape inference proves it (to 0 when the Reshape's input
    carries the batch as dim 0, to -1 when its input holds the batch once among fixed dims);
    ``Flatten(axis=0)`` at batch 1 becomes ``Flatten(axis=1)``. Constants that may hold the
    batch but cannot be proven to (ConstantOfShape, Expand of a batch-less tensor, unprovable
    Reshapes) are listed in ``unproven``, not changed.
    """
    proto = _copy(source)
    rewritten: list[str] = []
    dropped = _drop_initializer_inputs(proto)
    if dropped:
        rewritten.append(f"{dropped} initializer(s) removed from the graph inputs")
    batch = _fixed_batch(proto)
    for v in list(proto.graph.input) + list(proto.graph.output):
        dims = v.type.tensor_type.shape.dim
        if dims and (dims[0].HasField("dim_param") or dims[0].dim_value == batch):
            dims[0].Clear()
            dims[0].dim_param = name
    del proto.graph.value_info[:]
    unproven: list[str] = []
    if batch is not None:
        done: set[str] = set()
        while True:
            changed, unproven = _rewrite_round(proto, batch, name, done)
            rewritten += changed
            if not changed:
                break
    for line in rewritten:
        log.info("make_batch_dynamic: %s", line)
    for line in unproven:
        log.warning("make_batch_dynamic: %s", line)
    return BatchRewrite(proto, batch, tuple(rewritten), tuple(unproven))


def make_batch_dynamic(source: ModelSource, name: str = "batch") -> onnx.ModelProto:
    """Rewrite a fixed leading batch dim of inputs and outputs to the symbolic dim ``name``.

    See :func:`rewrite_batch` for what is rewritten; what could not be proven is logged as a
    warning. Run :func:`lint_batch` on the result to confirm every output follows the batch.
    """
    return rewrite_batch(source, name).model


@dataclasses.dataclass(frozen=True)
class LintIssue:
    """An output whose leading dim did not follow the batch size."""

    output: str
    batch: int
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"output {self.output!r} has shape {self.shape} at batch {self.batch}: its leading "
            "dim does not follow the batch (a batch size baked into a Reshape/Expand constant?)"
        )


def lint_batch(
    source: ModelSource, sizes: tuple[int, int] = (1, 3), dims: Mapping[str, int] | None = None
) -> list[LintIssue]:
    """Run the model at two batch sizes on ONNX Runtime CPU; report outputs that did not follow.

    Returns an empty list when every output's leading dim equals the batch size at both sizes.

    Raises:
        ModelError: the model has no dynamic leading dim on its inputs, or cannot run.
    """
    model = load_model(source)
    if not all(s.shape and isinstance(s.shape[0], str) for s in model.inputs):
        raise ModelError(
            "batch lint: not every input has a dynamic leading dim; run make_batch_dynamic first"
        )
    session = reference_session(model)
    names = [o.name for o in model.outputs]
    issues = []
    for b in sizes:
        feeds = random_feeds(model.inputs, concrete_shapes(model.inputs, None, batch=b, dims=dims))
        try:
            results = session.run(names, feeds)
        except Exception as exc:
            raise ModelError(f"batch lint: the model fails at batch {b}: {exc}") from None
        for n, r in zip(names, results):
            if r.ndim == 0 or r.shape[0] != b:
                issues.append(LintIssue(n, b, tuple(r.shape)))
    return issues
