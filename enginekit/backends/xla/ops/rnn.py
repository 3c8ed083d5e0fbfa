"""Recurrent ops: RNN, GRU and LSTM, each one ``jax.lax.scan`` per direction.

One function per op, inputs positional, attributes as keywords with the spec's defaults. The
input projection ``X W^T + Wb`` runs once for every step as one matmul before the scan; only the
recurrent part steps. ``sequence_lens`` is honoured the way the spec's reference does: a step
past a sequence's length keeps its state and outputs zeros, and the reverse direction reverses
each sequence within its own length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from enginekit.backends.xla.ops.common import OpError, to_jax

Act = Callable[[Any], Any]


def _activation(name: str, alpha: float | None, beta: float | None) -> Act:
    key = name.lower()
    if key == "tanh":
        return jnp.tanh
    if key == "sigmoid":
        return jax.nn.sigmoid
    if key == "relu":
        return jax.nn.relu
    if key == "softsign":
        return lambda x: x / (1 + jnp.abs(x))
    if key == "softplus":
        return jax.nn.softplus
    a = 0.01 if alpha is None else alpha
    if key == "leakyrelu":
        return lambda x: jnp.where(x >= 0, x, a * x)
    if key == "thresholdedrelu":
        t = 1.0 if alpha is None else alpha
        return lambda x: jnp.where(x > t, x, 0)
    if key == "elu":
        e = 1.0 if alpha is None else alpha
        return lambda x: jnp.where(x >= 0, x, e * (jnp.exp(x) - 1))
    if key == "hardsigmoid":
        ha, hb = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: jnp.clip(ha * x + hb, 0, 1)
    if key == "affine":
        fa, fb = (1.0 if alpha is None else alpha), (0.0 if beta is None else beta)
        return lambda x: fa * x + fb
    if key == "scaledtanh":
        sa, sb = (1.0 if alpha is None else alpha), (1.0 if beta is None else beta)
        return lambda x: sa * jnp.tanh(sb * x)
    raise OpError(f"recurrent activation {name!r} is not supported")


_TAKES_ALPHA = {"leakyrelu", "thresholdedrelu", "elu", "hardsigmoid", "affine", "scaledtanh"}
_TAKES_BETA = {"hardsigmoid", "affine", "scaledtanh"}


def _activations(
    names: Sequence[str] | None,
    defaults: Sequence[str],
    dirs: int,
    alpha: Sequence[float] | None,
    beta: Sequence[float] | None,
) -> list[list[Act]]:
    """Per direction, the op's activation functions (alpha/beta consumed in order)."""
    listed = list(names) if names else list(defaults) * dirs
    if len(listed) == len(defaults) and dirs == 2:
        listed = listed * 2
    alphas, betas = list(alpha or []), list(beta or [])
    made = []
    for name in listed:
        key = name.lower()
        a = alphas.pop(0) if key in _TAKES_ALPHA and alphas else None
        b = betas.pop(0) if key in _TAKES_BETA and betas else None
        made.append(_activation(name, a, b))
    per = len(defaults)
    return [made[d * per : (d + 1) * per] for d in range(dirs)]


def _directions(direction: str) -> list[bool]:
    """Per direction, whether it runs in reverse."""
    table = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}
    if direction not in table:
        raise OpError(f"direction {direction!r}: expected forward, reverse or bidirectional")
    return table[direction]


def _reverse_within(x: Any, lens: Any) -> Any:
    """[seq, batch, ...] with each batch entry's first lens[b] steps reversed."""
    steps = jnp.arange(x.shape[0])[:, None]
    source = jnp.where(steps < lens[None, :], lens[None, :] - 1 - steps, steps)
    index = source.reshape(source.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, jnp.broadcast_to(index, x.shape), axis=0)


def _run(
    X: Any,
    states: list[Any],
    sequence_lens: Any,
    layout: int,
    reverse_flags: list[bool],
    step: Callable[[int, Any, list[Any]], list[Any]],
) -> tuple[Any, list[Any]]:
    """Scan ``step(direction, x_t, states) -> new states`` (first state is h) over time.

    Returns Y [seq, dirs, batch, hidden] (or layout 1's [batch, seq, dirs, hidden]) and the
    final states, each [dirs, batch, hidden] (or [batch, dirs, hidden])."""
    x = to_jax(X)
    if layout:
        x = jnp.swapaxes(x, 0, 1)
    seq, batch = x.shape[0], x.shape[1]
    if sequence_lens is None:
        lens = jnp.full((batch,), seq, jnp.int32)
    else:
        lens = to_jax(sequence_lens).astype(jnp.int32)
    ys, finals = [], []
    for d, reverse in enumerate(reverse_flags):
        xs = _reverse_within(x, lens) if reverse else x
        init = [s[d] for s in states]

        def body(carry: list[Any], inputs: tuple[Any, Any], d: int = d) -> tuple[list[Any], Any]:
            x_t, t = inputs
            new = step(d, x_t, carry)
            live = (t < lens)[:, None]
            kept = [jnp.where(live, n, c) for n, c in zip(new, carry)]
            return kept, jnp.where(live, new[0], jnp.zeros((), new[0].dtype))

        last, y = jax.lax.scan(body, init, (xs, jnp.arange(seq)))
        if reverse:
            y = _reverse_within(y, lens)
        ys.append(y)
        finals.append(last)
    y_all = jnp.stack(ys, axis=1)  # [seq, dirs, batch, hidden]
    outs = [jnp.stack([f[i] for f in finals], axis=0) for i in range(len(states))]
    if layout:
        y_all = jnp.transpose(y_all, (2, 0, 1, 3))
        outs = [jnp.swapaxes(o, 0, 1) for o in outs]
    return y_all, outs


def _initial(value: Any, dirs: int, batch: Any, hidden: int, layout: int, dtype: Any) -> Any:
    if value is None:
        return jnp.zeros((dirs, batch, hidden), dtype)
    v = to_jax(value)
    return jnp.swapaxes(v, 0, 1) if layout else v


@dataclasses.dataclass(frozen=True)
class _Cell:
    """What every recurrent op reads from its inputs and attributes before its first step."""

    flags: list[bool]
    dtype: Any
    w: Any
    r: Any
    bias: Any  # [dirs, 2 * gates * hidden]: Wb then Rb
    hidden: int
    batch: Any
    acts: list[list[Act]]
    cut: Callable[[Any], Any]
    h0: Any


def _cell(
    op: str,
    gates: int,
    default_acts: list[str],
    X: Any,
    W: Any,
    R: Any,
    B: Any,
    initial_h: Any,
    attrs: dict[str, Any],
) -> _Cell:
    """Reads the inputs and attributes RNN, GRU and LSTM share (``attrs``: their keyword values)."""
    flags = _directions(attrs["direction"])
    w, r = to_jax(W), to_jax(R)
    hidden = attrs["hidden_size"] or r.shape[-1]
    if r.shape[-1] != hidden:
        raise OpError(f"{op}: R's last dim {r.shape[-1]} is not hidden_size {hidden}")
    x = to_jax(X)
    layout = attrs["layout"]
    batch = x.shape[0] if layout else x.shape[1]
    bias = jnp.zeros((w.shape[0], 2 * gates * hidden), x.dtype) if B is None else to_jax(B)
    acts = _activations(
        attrs["activations"],
        default_acts,
        len(flags),
        attrs["activation_alpha"],
        attrs["activation_beta"],
    )
    clip = attrs["clip"]
    cut = (lambda v: v) if clip is None else (lambda v: jnp.clip(v, -clip, clip))
    h0 = _initial(initial_h, len(flags), batch, hidden, layout, x.dtype)
    return _Cell(flags, x.dtype, w, r, bias, hidden, batch, acts, cut, h0)


def RNN(
    X: Any,
    W: Any,
    R: Any,
    B: Any = None,
    sequence_lens: Any = None,
    initial_h: Any = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
) -> tuple[Any, Any]:
    """Returns (Y, Y_h)."""
    c = _cell("RNN", 1, ["Tanh"], X, W, R, B, initial_h, locals())
    w, r, bias, n = c.w, c.r, c.bias, c.hidden

    def step(d: int, x_t: Any, s: list[Any]) -> list[Any]:
        pre = x_t @ w[d].T + s[0] @ r[d].T + bias[d, :n] + bias[d, n:]
        return [c.acts[d][0](c.cut(pre))]

    y, (h,) = _run(X, [c.h0], sequence_lens, layout, c.flags, step)
    return y, h


def GRU(
    X: Any,
    W: Any,
    R: Any,
    B: Any = None,
    sequence_lens: Any = None,
    initial_h: Any = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
) -> tuple[Any, Any]:
    """Returns (Y, Y_h); gates in the spec's z, r, h order."""
    c = _cell("GRU", 3, ["Sigmoid", "Tanh"], X, W, R, B, initial_h, locals())
    w, r, bias, n, acts, cut = c.w, c.r, c.bias, c.hidden, c.acts, c.cut

    def step(d: int, x_t: Any, s: list[Any]) -> list[Any]:
        h = s[0]
        wb, rb = bias[d, : 3 * n], bias[d, 3 * n :]
        xw = x_t @ w[d].T + wb
        rz = h @ r[d, : 2 * n].T + rb[: 2 * n]
        f, g = acts[d]
        z = f(cut(xw[:, :n] + rz[:, :n]))
        reset = f(cut(xw[:, n : 2 * n] + rz[:, n:]))
        if linear_before_reset:
            cand = xw[:, 2 * n :] + reset * (h @ r[d, 2 * n :].T + rb[2 * n :])
        else:
            cand = xw[:, 2 * n :] + (reset * h) @ r[d, 2 * n :].T + rb[2 * n :]
        cand = g(cut(cand))
        return [(1 - z) * cand + z * h]

    y, (h,) = _run(X, [c.h0], sequence_lens, layout, c.flags, step)
    return y, h


def LSTM(
    X: Any,
    W: Any,
    R: Any,
    B: Any = None,
    sequence_lens: Any = None,
    initial_h: Any = None,
    initial_c: Any = None,
    P: Any = None,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
) -> tuple[Any, Any, Any]:
    """Returns (Y, Y_h, Y_c); gates in the spec's i, o, f, c order, peepholes i, o, f."""
    cell = _cell("LSTM", 4, ["Sigmoid", "Tanh", "Tanh"], X, W, R, B, initial_h, locals())
    w, r, bias, n, acts, cut = cell.w, cell.r, cell.bias, cell.hidden, cell.acts, cell.cut
    dirs = len(cell.flags)
    c0 = _initial(initial_c, dirs, cell.batch, n, layout, cell.dtype)
    peep = jnp.zeros((dirs, 3 * n), cell.dtype) if P is None else to_jax(P)

    def step(d: int, x_t: Any, s: list[Any]) -> list[Any]:
        h, c = s
        f_act, g_act, h_act = acts[d]
        gates = x_t @ w[d].T + h @ r[d].T + bias[d, : 4 * n] + bias[d, 4 * n :]
        p_i, p_o, p_f = peep[d, :n], peep[d, n : 2 * n], peep[d, 2 * n :]
        i = f_act(cut(gates[:, :n] + p_i * c))
        f = f_act(cut(gates[:, 2 * n : 3 * n] + p_f * c))
        if input_forget:
            f = 1 - i
        cand = g_act(cut(gates[:, 3 * n :]))
        c_new = f * c + i * cand
        o = f_act(cut(gates[:, n : 2 * n] + p_o * c_new))
        return [o * h_act(c_new), c_new]

    y, (h, c) = _run(X, [cell.h0, c0], sequence_lens, layout, cell.flags, step)
    return y, h, c
