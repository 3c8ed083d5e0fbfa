"""Loops over subgraphs: Scan (one ``jax.lax.scan``) and Loop (unrolled when its trip count
and condition are known when the model is built).

The lowering hands an op with graph attributes a ``run`` callable that lowers a graph where the
node stands, reading the enclosing scope; a loop body, though, runs once per step on values the
loop makes. So the body is walked here, node by node through the same op table, in ONNX layout:
``run`` only fetches the outer-scope values the body reads. Inside a body, ops are resolved at
the newest opset; an op whose semantics changed between opsets (Softmax before 13, ...) is
refused, since the body cannot tell which one the model meant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.backends.xla.nodes import attributes, node_label, outer_names, subgraphs, topological
from enginekit.backends.xla.ops.common import OpError, is_static, to_jax

Runner = Callable[[Any], Sequence[Any]]
#: Loop unrolls at most this many steps (each step's nodes become part of the program).
MAX_UNROLL = 1024


def _outer_values(graph: onnx.GraphProto, run: Runner | None) -> dict[str, Any]:
    """The values ``graph`` reads from the scope around it, fetched through ``run``."""
    names = sorted(outer_names(graph))
    if not names:
        return {}
    if run is None:
        raise OpError("a loop body needs the lowering's graph runner")
    probe = onnx.helper.make_graph(
        [], "outer", [], [onnx.helper.make_empty_tensor_value_info(n) for n in names]
    )
    return dict(zip(names, run(probe)))


#: The op table, filled in by ``ops/__init__`` once it is built: it holds Loop and Scan
#: themselves, so this module cannot import it.
TABLE: dict[str, Any] = {}


def _resolve(op_type: str) -> Any:
    entry = TABLE.get(op_type)
    if entry is None:
        raise OpError(f"op {op_type} is not supported")
    if not callable(entry):
        raise OpError(
            f"op {op_type} inside a loop body: its semantics depend on the model's opset, "
            "which a loop body does not see"
        )
    return entry


def evaluate(graph: onnx.GraphProto, feeds: dict[str, Any], scope: dict[str, Any]) -> list[Any]:
    """Lower ``graph``'s nodes on ``feeds`` (its inputs) and ``scope`` (outer values)."""
    values = {**scope, **feeds}
    values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer})
    for index, node in enumerate(topological(graph, frozenset(values))):
        label = node_label(node, index)
        try:
            fn = _resolve(node.op_type)
            attrs = attributes(node)
            if node.op_type == "Split" and "split" not in attrs and len(node.input) < 2:
                attrs.setdefault("num_outputs", len(node.output))
            if subgraphs(node):
                here = dict(values)
                attrs["run"] = lambda g, here=here: evaluate(g, {}, here)
            result = fn(*[values[i] if i else None for i in node.input], **attrs)
        except OpError as exc:
            raise OpError(f"body {graph.name!r} node {label}: {exc}") from None
        results = result if isinstance(result, tuple) else (result,)
        for name, value in zip(node.output, results):
            if name:
                values[name] = value
    return [values[o.name] for o in graph.output]


def _along(x: Any, axis: int, reverse: bool) -> Any:
    """``x`` with ``axis`` moved first (and reversed): the order a scan walks it."""
    x = jnp.moveaxis(to_jax(x), axis, 0)
    return jnp.flip(x, 0) if reverse else x


def _scan(
    states: list[Any],
    scans: list[Any],
    body: onnx.GraphProto,
    scope: dict[str, Any],
    in_axes: list[int],
    in_dirs: list[int],
    out_axes: list[int] | None,
    out_dirs: list[int] | None,
) -> list[Any]:
    n = len(states)
    xs = [_along(x, a % x.ndim, bool(d)) for x, a, d in zip(scans, in_axes, in_dirs)]
    names = [i.name for i in body.input]

    def step(carry: list[Any], sliced: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = evaluate(body, dict(zip(names, [*carry, *sliced])), scope)
        new = [to_jax(o).astype(c.dtype) for o, c in zip(outs[:n], carry)]
        return new, [to_jax(o) for o in outs[n:]]

    final, stacked = jax.lax.scan(step, [to_jax(s) for s in states], xs)
    k = len(stacked)
    axes_out = out_axes or [0] * k
    dirs_out = out_dirs or [0] * k
    results = []
    for y, a, d in zip(stacked, axes_out, dirs_out):
        y = jnp.flip(y, 0) if d else y
        results.append(jnp.moveaxis(y, 0, a % y.ndim))
    return [*final, *results]


def Scan(
    *inputs: Any,
    body: Any = None,
    num_scan_inputs: int = 0,
    scan_input_axes: list[int] | None = None,
    scan_input_directions: list[int] | None = None,
    scan_output_axes: list[int] | None = None,
    scan_output_directions: list[int] | None = None,
    run: Runner | None = None,
) -> tuple[Any, ...]:
    """Opset 9+: states, then ``num_scan_inputs`` tensors sliced along their scan axes."""
    m = num_scan_inputs
    states, scans = list(inputs[: len(inputs) - m]), list(inputs[len(inputs) - m :])
    return tuple(
        _scan(
            states,
            scans,
            body,
            _outer_values(body, run),
            scan_input_axes or [0] * m,
            scan_input_directions or [0] * m,
            scan_output_axes,
            scan_output_directions,
        )
    )


def Scan_8(
    sequence_lens: Any,
    *inputs: Any,
    body: Any = None,
    num_scan_inputs: int = 0,
    directions: list[int] | None = None,
    run: Runner | None = None,
) -> tuple[Any, ...]:
    """Opset 8: a leading batch axis on every input, scanned along axis 1."""
    m = num_scan_inputs
    if sequence_lens is not None:
        lens = np.asarray(sequence_lens) if is_static(sequence_lens) else None
        full = inputs[-1].shape[1] if m else None
        if lens is None or not np.all(lens == full):
            raise OpError(
                "Scan (opset 8) with sequence_lens shorter than the inputs is not supported"
            )
    scope = _outer_values(body, run)
    states, scans = list(inputs[: len(inputs) - m]), list(inputs[len(inputs) - m :])
    dirs = directions or [0] * m

    def one(batch_states: list[Any], batch_scans: list[Any]) -> list[Any]:
        return _scan(batch_states, batch_scans, body, scope, [0] * m, dirs, None, None)

    return tuple(jax.vmap(one)([to_jax(s) for s in states], [to_jax(x) for x in scans]))


def Loop(
    M: Any,
    cond: Any,
    *v_initial: Any,
    body: Any = None,
    run: Runner | None = None,
) -> tuple[Any, ...]:
    """Unrolled: needs the trip count (or a condition that turns false) known at build time."""
    if M is not None and not is_static(M):
        raise OpError("Loop's trip count is computed at run time; XLA needs it fixed to unroll")
    if cond is not None and not is_static(cond):
        raise OpError("Loop's condition is computed at run time; XLA needs it fixed to unroll")
    trips = int(np.asarray(M).reshape(-1)[0]) if M is not None else MAX_UNROLL + 1
    going = bool(np.asarray(cond).reshape(-1)[0]) if cond is not None else True
    scope = _outer_values(body, run)
    names = [i.name for i in body.input]
    carried = list(v_initial)
    n = len(carried)
    collected: list[list[Any]] = []
    step = 0
    while going and step < trips:
        if step >= MAX_UNROLL:
            raise OpError(f"Loop runs past {MAX_UNROLL} steps; XLA needs a bounded, unrolled loop")
        feeds = dict(zip(names, [np.asarray(step, np.int64), np.asarray(going), *carried]))
        outs = evaluate(body, feeds, scope)
        if not is_static(outs[0]):
            raise OpError("Loop's condition is computed at run time; XLA needs it fixed to unroll")
        going = bool(np.asarray(outs[0]).reshape(-1)[0])
        carried = list(outs[1 : 1 + n])
        collected.append(list(outs[1 + n :]))
        step += 1
    k = len(body.output) - 1 - n
    if not collected and k:
        raise OpError("Loop ran no step: the shapes of its scan outputs are unknown")
    stacked = [jnp.stack([to_jax(c[i]) for c in collected]) for i in range(k)]
    return (*carried, *stacked)
