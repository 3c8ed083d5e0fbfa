"""Ops of state-space and linear-attention models (opset 27): CausalConvWithState and
LinearAttention, each returning its output and the state to feed the next call.

One function per op, inputs positional, attributes as keywords with the spec's defaults.
LinearAttention's recurrence is one ``jax.lax.scan`` over time in float32, as the spec's
reference computes it; ``chunk_size`` is a tuning hint that changes no result.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from enginekit.backends.xla.ops.common import OpError, to_jax


def CausalConvWithState(
    input: Any, weight: Any, bias: Any = None, past_state: Any = None, activation: str = "none"
) -> tuple[Any, Any]:
    """Returns (output, present_state): a depthwise 1-D convolution over [batch, C, length]
    that sees the previous call's last k-1 steps (``past_state``) before its input."""
    if activation not in ("none", "silu", "swish"):
        raise OpError(
            f"CausalConvWithState activation {activation!r}: expected none, silu or swish"
        )
    x, w = to_jax(input), to_jax(weight)
    if x.ndim != 3 or w.ndim != 3:
        raise OpError("CausalConvWithState needs input [batch, C, length] and weight [C, 1, k]")
    batch, channels = x.shape[0], x.shape[1]
    k = w.shape[2]
    pad = jnp.zeros((batch, channels, k - 1), x.dtype) if past_state is None else to_jax(past_state)
    padded = jnp.concatenate([pad, x], axis=2)
    out = jax.lax.conv_general_dilated(
        padded.astype(jnp.float32),
        w.astype(jnp.float32),
        window_strides=(1,),
        padding=[(0, 0)],
        dimension_numbers=("NCH", "OIH", "NCH"),
        feature_group_count=channels,
        precision=jax.lax.Precision.HIGHEST,
    )
    if bias is not None:
        out = out + to_jax(bias).astype(jnp.float32)[None, :, None]
    out = out.astype(x.dtype)
    if activation != "none":
        wide = out.astype(jnp.float32)
        out = (wide * jax.nn.sigmoid(wide)).astype(x.dtype)
    return out, padded[:, :, padded.shape[2] - (k - 1) :]


def _heads(x: Any, heads: int, what: str) -> Any:
    """[batch, T, heads * size] -> [batch, heads, T, size] in float32."""
    b, t, hidden = x.shape
    if hidden % heads:
        raise OpError(f"LinearAttention: {what}'s last dim {hidden} is not a multiple of {heads}")
    return jnp.transpose(jnp.reshape(x, (b, t, heads, hidden // heads)), (0, 2, 1, 3)).astype(
        jnp.float32
    )


def LinearAttention(
    query: Any,
    key: Any,
    value: Any,
    past_state: Any = None,
    decay: Any = None,
    beta: Any = None,
    chunk_size: int = 64,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    scale: float = 0.0,
    update_rule: str = "gated_delta",
) -> tuple[Any, Any]:
    """Returns (output [batch, T, q_heads * d_v], present_state [batch, kv_heads, d_k, d_v])."""
    rules = ("linear", "gated", "delta", "gated_delta")
    if update_rule not in rules:
        raise OpError(f"LinearAttention update_rule {update_rule!r}: expected one of {rules}")
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise OpError(
            f"LinearAttention needs q_num_heads ({q_num_heads}) a positive multiple of "
            f"kv_num_heads ({kv_num_heads})"
        )
    gating = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gating != (decay is not None) or delta != (beta is not None):
        raise OpError(
            f"LinearAttention update_rule {update_rule!r} needs decay {'given' if gating else 'omitted'} "
            f"and beta {'given' if delta else 'omitted'}"
        )
    q_in = to_jax(query)
    b, t, _ = q_in.shape
    q = _heads(q_in, q_num_heads, "query")
    k = _heads(to_jax(key), kv_num_heads, "key")
    v = _heads(to_jax(value), kv_num_heads, "value")
    d_k, d_v = q.shape[-1], v.shape[-1]
    group = q_num_heads // kv_num_heads
    steps: list[Any] = [q, k, v]
    if gating:
        g = to_jax(decay)
        if g.shape[-1] == kv_num_heads:
            g = jnp.transpose(jnp.reshape(g, (b, t, kv_num_heads, 1)), (0, 2, 1, 3))
        else:
            g = _heads(g, kv_num_heads, "decay")
        steps.append(g.astype(jnp.float32))
    if delta:
        bt = to_jax(beta)
        bt = jnp.transpose(jnp.reshape(bt, (b, t, bt.shape[-1], 1)), (0, 2, 1, 3))
        steps.append(bt.astype(jnp.float32))
    if past_state is None:
        state0 = jnp.zeros((b, kv_num_heads, d_k, d_v), jnp.float32)
        state_dtype = q_in.dtype
    else:
        state0 = to_jax(past_state).astype(jnp.float32)
        state_dtype = past_state.dtype
    factor = scale if scale else 1.0 / float(d_k) ** 0.5

    def step(state: Any, xs: tuple[Any, ...]) -> tuple[Any, Any]:
        q_t, k_t, v_t, *rest = xs
        if gating:
            state = state * jnp.exp(rest.pop(0))[..., None]
        if delta:
            retrieved = jnp.einsum("bhdm,bhd->bhm", state, k_t, precision="highest")
            v_t = rest.pop(0) * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = jnp.repeat(state, group, axis=1) if group > 1 else state
        out = factor * jnp.einsum("bhd,bhdm->bhm", q_t, read, precision="highest")
        return state, out

    over_time = tuple(jnp.moveaxis(s, 2, 0) for s in steps)  # [T, batch, heads, ...]
    state, outs = jax.lax.scan(step, state0, over_time)
    output = jnp.reshape(jnp.transpose(outs, (1, 0, 2, 3)), (b, t, q_num_heads * d_v))
    return output.astype(q_in.dtype), state.astype(state_dtype)
