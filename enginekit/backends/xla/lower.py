"""ONNX graph -> a pure JAX function of (weights, inputs).

The walk, in order:

1. ``check``: every node's op (and attribute names) is in the op table, before anything is
   traced or compiled; a BuildError lists every node that is not.
2. ``lower``: constants fold in numpy (shape arithmetic, DequantizeLinear on weights, weight
   transposes); what stays constant and is large becomes a weight — a function argument, not an
   HLO constant, so compiles stay fast — rearranged once into the layout its consumers want.
3. The returned function walks the nodes in topological order, calling one op function per node
   and tracking each tensor's layout (``layout.py``), converting only where a consumer needs
   another layout. Static values stay numpy during tracing, so Shape -> Gather -> Concat ->
   Reshape chains never reach the compiled program.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.backends.xla import graph as graph_
from enginekit.backends.xla import layout as lay
from enginekit.backends.xla import precision as reduced
from enginekit.backends.xla.check import LEGACY_BINARY, check, opset_of
from enginekit.backends.xla.graph import prepare
from enginekit.backends.xla.nodes import attributes, node_label, subgraphs, topological, uses
from enginekit.errors import BuildError

log = logging.getLogger(__name__)

#: Constants with more elements than this are passed as weights (jit arguments).
INLINE_LIMIT = 64
#: A constant-folded result may grow to this many elements, or its inputs' total.
FOLD_LIMIT = 1 << 16
#: Ops whose opset < 7 forms broadcast in ways channels-last alignment does not model.
_LEGACY_BROADCAST = LEGACY_BINARY | {"PRelu"}
#: Ops whose operands are all data: symbolic-dim values among traced ones become traced.
_MIXING = lay.ELEMENTWISE | {"Concat"}


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A model lowered to ``fn(weights, inputs) -> outputs``, each a tuple of arrays.

    Attributes:
        fn: the pure function jax traces; ``weights`` in ``weight_names`` order.
        weights: the weight arrays, already in the layout ``fn`` expects.
        weight_names: ONNX names of the weights (for the payload file).
        weight_layouts: layout tag of each weight.
        inputs, outputs: ONNX names of the graph inputs and outputs, in order.
        layout: ``"nhwc"`` or ``"nchw"``.
        stats: counts for the manifest: folded nodes, weights, ...; ``layout_conversions``
            (transposes the program makes between layouts) is filled in when ``fn`` is traced.
    """

    fn: Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]
    weights: tuple[np.ndarray, ...]
    weight_names: tuple[str, ...]
    weight_layouts: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layout: str
    stats: dict[str, Any]


# -- constant folding and weights ---------------------------------------------------------------


def _call(fn: Callable[..., Any], args: Sequence[Any], attrs: dict[str, Any]) -> tuple[Any, ...]:
    result = fn(*args, **attrs)
    return result if isinstance(result, tuple) else (result,)


def _as_numpy(value: Any) -> np.ndarray | None:
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    try:
        return np.asarray(value)
    except Exception:  # a tracer or symbolic value: not foldable
        return None


def _fold(nodes: list[onnx.NodeProto], consts: dict[str, np.ndarray], opset: int) -> set[int]:
    """Evaluate every node whose inputs are all constant; returns the folded node ids."""
    import jax

    from enginekit.backends.xla.ops import resolve

    folded: set[int] = set()
    for node in nodes:
        present = [i for i in node.input if i]
        if not all(i in consts for i in present) or node.op_type in lay.ANCHORS | lay.FOLLOWERS:
            continue
        if subgraphs(node):  # If: chosen while tracing, where its branch can be lowered
            continue
        fn = resolve(node.op_type, opset)
        if fn is None:
            continue
        attrs = _prepared_attrs(node, opset)
        args = [consts[i] if i else None for i in node.input]
        try:
            with jax.enable_x64(True):
                results = _call(fn, args, attrs)
        except Exception:  # let tracing report it, with the node named
            continue
        arrays = [_as_numpy(r) for r in results]
        budget = max(FOLD_LIMIT, sum(consts[i].size for i in present))
        if any(a is None or a.dtype == object or a.size > budget for a in arrays):
            continue
        for name, a in zip(node.output, arrays):
            if name:
                consts[name] = a  # type: ignore[assignment]
        folded.add(id(node))
    return folded


def _prepared_attrs(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    attrs = attributes(node)
    if node.op_type == "Split" and "split" not in attrs and len(node.input) < 2:
        attrs.setdefault("num_outputs", len(node.output))
    if opset < 7 and node.op_type in LEGACY_BINARY:
        attrs.pop("broadcast", None)
        attrs.pop("axis", None)
    return attrs


def _initializers(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}


# -- tracing --------------------------------------------------------------------------------


class Env:
    """Values by ONNX name, each held in some layout; converts (and caches) on demand."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}
        self._converted: dict[tuple[str, str], Any] = {}
        self.conversions = 0

    def put(self, name: str, value: Any, tag: str) -> None:
        if isinstance(value, np.generic):
            value = np.asarray(value)
        elif not hasattr(value, "shape"):  # a bare symbolic dim or int from numpy arithmetic
            plain = isinstance(value, (bool, int, float))
            value = np.asarray(value) if plain else np.asarray(value, dtype=object)
        self.values[name] = (value, tag)

    def layout(self, name: str) -> str:
        return self.values[name][1]

    def rank(self, name: str) -> int:
        return int(np.ndim(self.values[name][0]))

    def raw(self, name: str) -> Any:
        return self.values[name][0]

    def get(self, name: str, want: str) -> Any:
        value, have = self.values[name]
        if have == want or np.ndim(value) < 3:
            return value
        key = (name, want)
        if key not in self._converted:
            onnx_value = lay.from_layout(value, have)
            converted = lay.to_layout(onnx_value, want)
            if not isinstance(converted, np.ndarray):
                self.conversions += 1
            self._converted[key] = converted
        return self._converted[key]

    def aligned(self, name: str, rank: int) -> Any:
        """The value broadcast-aligned to a channels-last operand of rank ``rank``."""
        value, have = self.values[name]
        if have == lay.NHWC:
            return value
        if _single(np.shape(value)):
            return value
        key = (name, f"aligned{rank}")
        if key not in self._converted:
            m = np if isinstance(value, np.ndarray) else _jnp()
            padded = m.reshape(value, (1,) * (rank - np.ndim(value)) + tuple(np.shape(value)))
            converted = lay.to_layout(padded, lay.NHWC)
            if m is not np:
                self.conversions += 1
            self._converted[key] = converted
        return self._converted[key]


def _single(shape: Sequence[Any]) -> bool:
    """Whether a tensor of ``shape`` holds one element; symbolic dims (``batch``) never count
    as 1, and their products are never compared (that raises InconclusiveDimensionOperation)."""
    return all(isinstance(d, (int, np.integer)) and d == 1 for d in shape)


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


@dataclasses.dataclass
class _Call:
    args: list[Any]
    attrs: dict[str, Any]
    out_tag: str


def _plan_call(
    env: Env, node: onnx.NodeProto, opset: int, attrs: dict[str, Any], nhwc: bool
) -> _Call:
    """Fetch the node's inputs in the layouts the op will be called with."""
    op = node.op_type
    names = list(node.input)

    def onnx_args() -> list[Any]:
        return [env.get(n, lay.ONNX) if n else None for n in names]

    if not names or not names[0]:
        return _Call(onnx_args(), attrs, lay.ONNX)
    first_tag = env.layout(names[0])
    rank = env.rank(names[0])
    if op in lay.ANCHORS and not (nhwc and rank >= 3):
        # NCHW mode: kernels may still need rewriting (ConvTranspose's forward kernel).
        args = [
            env.get(n, lay.weight_layout(op, i, attrs, False)) if n else None
            for i, n in enumerate(names)
        ]
        return _Call(args, attrs, lay.ONNX)
    if not nhwc:
        return _Call(onnx_args(), attrs, lay.ONNX)
    if op in lay.ANCHORS:
        args = [
            env.get(n, lay.NHWC if i == 0 else lay.weight_layout(op, i, attrs, True)) if n else None
            for i, n in enumerate(names)
        ]
        return _Call(args, {**attrs, "channels_last": True}, lay.NHWC)
    if op in lay.FOLLOWERS and first_tag == lay.NHWC:
        args = [env.raw(names[0])] + [env.get(n, lay.ONNX) if n else None for n in names[1:]]
        return _Call(args, {**attrs, "channels_last": True}, lay.NHWC)
    if op in lay.ELEMENTWISE and not (opset < 7 and op in _LEGACY_BROADCAST):
        present = [n for n in names if n]
        top = max(env.rank(n) for n in present)
        if top >= 3 and any(env.layout(n) == lay.NHWC and env.rank(n) == top for n in present):
            return _Call([env.aligned(n, top) if n else None for n in names], attrs, lay.NHWC)
        return _Call(onnx_args(), attrs, lay.ONNX)
    if op in lay.AXIS_OPS and rank >= 3:
        tagged = names if op == "Concat" else names[:1]
        if any(env.layout(n) == lay.NHWC for n in tagged if n):
            remapped = lay.remap_axis_attrs(op, opset, attrs, rank)
            if remapped is not None:
                args = [
                    env.get(n, lay.NHWC if n in tagged else lay.ONNX) if n else None for n in names
                ]
                return _Call(args, remapped, lay.NHWC)
    if first_tag == lay.NHWC and rank >= 3:
        remap = None
        rest = [env.get(n, lay.ONNX) if n else None for n in names[1:]]
        candidate = [env.raw(names[0]), *rest]
        if op in lay.REDUCTIONS:
            remap = lay.remap_reduce(candidate, attrs, rank)
        elif op == "Pad":
            remap = lay.remap_pad(candidate, attrs, rank)
        elif op in lay.QUANT:
            remap = lay.remap_quant(candidate, attrs, rank)
        if remap is not None:
            return _Call(remap[0], remap[1], lay.NHWC)
    return _Call(onnx_args(), attrs, lay.ONNX)


def _legacy_broadcast(args: list[Any], node: onnx.NodeProto) -> list[Any]:
    """Opset < 7 binary ops: ``broadcast=1, axis=k`` aligns B's dims at A's axis k."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("broadcast") or "axis" not in attrs or len(args) < 2:
        return args
    a, b = args[0], args[1]
    first = int(attrs["axis"]) % max(np.ndim(a), 1)
    trailing = np.ndim(a) - first - np.ndim(b)
    m = np if isinstance(b, np.ndarray) else _jnp()
    return [a, m.reshape(b, tuple(np.shape(b)) + (1,) * trailing), *args[2:]]


def _run_node(
    env: Env, node: onnx.NodeProto, index: int, opset: int, nhwc: bool, low: Any = None
) -> None:
    from enginekit.backends.xla.ops import resolve
    from enginekit.backends.xla.ops.common import is_static, to_jax

    fn = resolve(node.op_type, opset)
    label = node_label(node, index)
    if fn is None:
        raise BuildError(f"node {label}: op {node.op_type} is not supported")
    try:
        call = _plan_call(env, node, opset, _prepared_attrs(node, opset), nhwc)
        args = call.args
        if opset < 7 and node.op_type in LEGACY_BINARY:
            args = _legacy_broadcast(args, node)
        if low is not None:
            args = reduced.at_precision(node.op_type, args, low)
        if node.op_type in _MIXING and not all(a is None or is_static(a) for a in args):
            # Symbolic dims meeting traced data as operands: make them traced values too.
            args = [to_jax(a) if a is not None else None for a in args]
        attrs = call.attrs
        if subgraphs(node):
            attrs = {**attrs, "run": lambda graph: _run_graph(env, graph, opset, nhwc, low)}
        results = _call(fn, args, attrs)
    except BuildError as exc:
        raise BuildError(f"node {label}: {exc}") from None
    except Exception as exc:
        raise BuildError(f"node {label}: lowering failed: {type(exc).__name__}: {exc}") from exc
    wanted = [i for i, name in enumerate(node.output) if name]
    if wanted and max(wanted) >= len(results):
        missing = ", ".join(node.output[i] for i in wanted if i >= len(results))
        raise BuildError(f"node {label}: output(s) {missing} are not supported by the XLA backend")
    for name, value in zip(node.output, results):
        if name:
            env.put(name, reduced.narrow(value, low), call.out_tag)


def _run_graph(
    env: Env, graph: onnx.GraphProto, opset: int, nhwc: bool, low: Any = None
) -> list[Any]:
    """Lower a subgraph (an If branch) in ``env``; its outputs, in ONNX layout."""
    for t in graph.initializer:
        env.put(t.name, numpy_helper.to_array(t), lay.ONNX)
    for index, node in enumerate(topological(graph, frozenset(env.values))):
        _run_node(env, node, index, opset, nhwc, low)
    return [env.get(o.name, lay.ONNX) for o in graph.output]


def lower(
    proto: onnx.ModelProto,
    layout: str = "nhwc",
    inline_limit: int = INLINE_LIMIT,
    precision: str = "fp32",
) -> Lowered:
    """Lower a checked model to a pure function of (weights, inputs).

    Args:
        proto: the ONNX model (external data loaded).
        layout: ``"nhwc"`` keeps activations channels-last through conv/pool chains;
            ``"nchw"`` runs convolutions in ONNX's own layout.
        inline_limit: constants up to this many elements are baked into the program;
            larger ones become weights.
        precision: ``fp32``, or ``bf16``/``fp16``: float32 weights are stored in that type,
            float32 inputs cast to it on entry and outputs back to float32 on exit, every
            float32 result in between held in it; ``precision.WIDE_OPS`` compute in float32.
    """
    if layout not in ("nhwc", "nchw"):
        raise BuildError(f"layout {layout!r}: expected 'nhwc' or 'nchw'")
    if precision != "fp32" and precision not in reduced.LOW_PRECISION:
        raise BuildError(
            f"precision {precision!r}: expected fp32, {', '.join(reduced.LOW_PRECISION)}"
        )
    low = reduced.low_dtype(precision)
    proto = prepare(proto)
    check(proto)
    graph = proto.graph
    opset = opset_of(proto)
    nodes = topological(graph)
    consts = _initializers(graph)
    folded = _fold(nodes, consts, opset)
    outputs = tuple(o.name for o in graph.output)
    live = graph_.pretransposed_gemms(
        [n for n in nodes if id(n) not in folded], consts, set(outputs)
    )
    nhwc = layout == "nhwc"
    inputs = tuple(i.name for i in graph.input if i.name not in consts)
    used = {i for n in live for i in uses(n) if i in consts} | {o for o in outputs if o in consts}
    weight_names = tuple(sorted(n for n in used if consts[n].size > inline_limit))
    statics = {n: consts[n] for n in used if n not in weight_names}
    tags = tuple(_weight_tag(name, live, outputs, nhwc) for name in weight_names)
    weights = tuple(
        np.ascontiguousarray(reduced.narrow_weight(lay.to_layout(consts[n], t), low))
        for n, t in zip(weight_names, tags)
    )
    out_types = [o.type.tensor_type.elem_type for o in graph.output]
    stats: dict[str, Any] = {
        "nodes": len(nodes),
        "folded_nodes": len(folded),
        "weights": len(weights),
        "weight_bytes": int(sum(w.nbytes for w in weights)),
        "inlined_constants": len(statics),
        "pretransformed_weights": sum(t != lay.ONNX for t in tags),
    }
    order = list(enumerate(live))

    def fn(weight_args: tuple[Any, ...], input_args: tuple[Any, ...]) -> tuple[Any, ...]:
        import jax.numpy as jnp

        env = Env()
        for name, value in statics.items():
            env.put(name, value, lay.ONNX)
        for name, value, tag in zip(weight_names, weight_args, tags):
            env.put(name, value, tag)
        for name, value in zip(inputs, input_args):
            env.put(name, reduced.narrow(value, low), lay.ONNX)
        for index, node in order:
            _run_node(env, node, index, opset, nhwc, low)
        results = tuple(
            reduced.widen(jnp.asarray(_concrete(env.get(name, lay.ONNX))), low)
            if kind == onnx.TensorProto.FLOAT
            else jnp.asarray(_concrete(env.get(name, lay.ONNX)))
            for name, kind in zip(outputs, out_types)
        )
        stats["layout_conversions"] = env.conversions
        return results

    return Lowered(fn, weights, weight_names, tags, inputs, outputs, layout, stats)


def _concrete(value: Any) -> Any:
    from enginekit.backends.xla.ops.common import to_jax

    return to_jax(value)


def _weight_tag(name: str, live: list[onnx.NodeProto], outputs: tuple[str, ...], nhwc: bool) -> str:
    """The layout every consumer of weight ``name`` wants, or ONNX when they disagree."""
    wanted = {lay.ONNX} if name in outputs else set()
    for node in live:
        if name in uses(node)[len(node.input) :]:
            wanted.add(lay.ONNX)  # read inside a branch
        for i, n in enumerate(node.input):
            if n != name:
                continue
            if node.op_type in lay.ANCHORS:
                wanted.add(lay.weight_layout(node.op_type, i, attributes(node), nhwc))
            else:
                wanted.add(lay.ONNX)
    return wanted.pop() if len(wanted) == 1 else lay.ONNX
