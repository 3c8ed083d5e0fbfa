"""Attention ops of opsets 23+: Attention (with KV cache, masks, causal and sliding windows,
grouped-query heads, softcap) and RotaryEmbedding.

One function per op, inputs positional, attributes as keywords with the spec's defaults. The
masks follow the reference's select-not-multiply form (an allowed position adds 0, a masked one
-inf), and a row with every key masked gives zeros, not NaN, as the spec asks.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import onnx

from enginekit.backends.xla.ops.common import OpError, to_jax


def _heads(x: Any, heads: int | None, what: str) -> Any:
    """[batch, seq, heads * size] -> [batch, heads, seq, size]."""
    if heads is None:
        raise OpError(f"Attention with 3-D inputs needs the {what} attribute")
    b, s, hidden = x.shape
    return jnp.transpose(jnp.reshape(x, (b, s, heads, hidden // heads)), (0, 2, 1, 3))


def _window_bias(q_len: int, kv_len: int, offset: Any, allowed_fn: Any, dtype: Any) -> Any:
    """0 where ``allowed_fn(diff)`` holds, -inf elsewhere; ``diff`` = query position - key
    position, queries shifted by ``offset`` (a scalar, or per batch: then [batch, 1, q, kv])."""
    i = np.arange(q_len).reshape(q_len, 1)
    j = np.arange(kv_len).reshape(1, kv_len)
    if np.ndim(offset) > 0:
        diff = (i + jnp.reshape(offset, (-1, 1, 1))) - j
        allowed = allowed_fn(diff)[:, None]
    else:
        allowed = allowed_fn(i + offset - j)
    return jnp.where(allowed, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))


def _safe_softmax(x: Any) -> Any:
    """Softmax over the last axis whose all -inf rows give zeros (no NaN)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    top = jnp.where(jnp.isneginf(top), jnp.zeros((), x.dtype), top)
    e = jnp.exp(x - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total == 0, jnp.ones((), x.dtype), total)


def Attention(
    Q: Any,
    K: Any,
    V: Any,
    attn_mask: Any = None,
    past_key: Any = None,
    past_value: Any = None,
    nonpad_kv_seqlen: Any = None,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    left_window_size: int = -1,
    right_window_size: int = -1,
) -> tuple[Any, Any, Any, Any]:
    """Returns (Y, present_key, present_value, qk_matmul_output)."""
    if (past_key is None) != (past_value is None):
        raise OpError("Attention needs past_key and past_value together, or neither")
    q, k, v = to_jax(Q), to_jax(K), to_jax(V)
    out_dtype = q.dtype
    if out_dtype in (jnp.float16, jnp.bfloat16):
        # Half-precision attention computes in float32 and rounds once at the end, as ONNX
        # Runtime's CPU kernel does: per-op half rounding drifts past verification.
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    dtype = q.dtype
    three_d = q.ndim == 3
    if three_d:
        q = _heads(q, q_num_heads, "q_num_heads")
        k = _heads(k, kv_num_heads, "kv_num_heads")
        v = _heads(v, kv_num_heads, "kv_num_heads")
    root = np.sqrt(scale if scale is not None else 1 / np.sqrt(q.shape[3]))
    root = jnp.asarray(root, dtype)
    if past_key is not None:
        k = jnp.concatenate([to_jax(past_key), k], axis=2)
        v = jnp.concatenate([to_jax(past_value), v], axis=2)
    present_key, present_value = k.astype(out_dtype), v.astype(out_dtype)
    q_len, kv_len = q.shape[2], k.shape[2]
    bias: Any = jnp.zeros((q_len, kv_len), dtype)
    mask = None if attn_mask is None else to_jax(attn_mask)
    if mask is not None:
        missing = kv_len - mask.shape[-1]
        if missing > 0:
            fill = False if mask.dtype == jnp.bool_ else -jnp.inf
            pads = [(0, 0)] * (mask.ndim - 1) + [(0, missing)]
            mask = jnp.pad(mask, pads, constant_values=fill)
        if mask.dtype == jnp.bool_:
            mask = jnp.where(mask, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
        bias = bias + mask.astype(dtype)
    if nonpad_kv_seqlen is not None and past_key is None:
        offset: Any = jnp.reshape(to_jax(nonpad_kv_seqlen), (-1,)) - q_len
    else:
        offset = past_key.shape[2] if past_key is not None else 0
    if is_causal:
        bias = bias + _window_bias(q_len, kv_len, offset, lambda d: d >= 0, dtype)
    if left_window_size >= 0 or right_window_size >= 0:

        def inside(d: Any) -> Any:
            ok = d == d
            if left_window_size >= 0:
                ok = ok & (d <= left_window_size)
            if right_window_size >= 0:
                ok = ok & (-d <= right_window_size)
            return ok

        bias = bias + _window_bias(q_len, kv_len, offset, inside, dtype)
    if nonpad_kv_seqlen is not None:
        lens = jnp.reshape(to_jax(nonpad_kv_seqlen), (-1, 1))
        padding = jnp.arange(kv_len)[None, :] < lens
        padding = jnp.where(padding, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
        bias = bias + jnp.reshape(padding, (-1, 1, 1, kv_len))
    heads_q = q.shape[1]
    heads_kv = k.shape[1]
    if heads_q != heads_kv:
        if heads_q % heads_kv:
            raise OpError(f"Attention: {heads_q} query heads are not a multiple of {heads_kv}")
        k = jnp.repeat(k, heads_q // heads_kv, axis=1)
        v = jnp.repeat(v, heads_q // heads_kv, axis=1)
    scores = jnp.matmul(q * root, jnp.swapaxes(k * root, -1, -2))
    if softcap:
        scores = jnp.tanh(scores / jnp.asarray(softcap, dtype)) * jnp.asarray(softcap, dtype)
    with_bias = scores + bias
    exposed = with_bias if qk_matmul_output_mode == 2 else scores
    if softmax_precision is not None:
        with_bias = with_bias.astype(onnx.helper.tensor_dtype_to_np_dtype(softmax_precision))
    probs = _safe_softmax(with_bias)
    masked_row = jnp.isneginf(jnp.max(bias, axis=-1, keepdims=True))
    probs = jnp.where(masked_row, jnp.zeros((), probs.dtype), probs)
    if qk_matmul_output_mode == 3:
        exposed = probs
    y = jnp.matmul(probs.astype(dtype), v)
    if three_d:
        y = jnp.transpose(y, (0, 2, 1, 3))
        y = jnp.reshape(y, (y.shape[0], y.shape[1], -1))
    return y.astype(out_dtype), present_key, present_value, exposed.astype(out_dtype)


def RotaryEmbedding(
    X: Any,
    cos_cache: Any,
    sin_cache: Any,
    position_ids: Any = None,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> Any:
    x = to_jax(X)
    shape = x.shape
    if x.ndim == 4:  # [batch, heads, seq, size] -> [batch, seq, heads, size]
        x = jnp.transpose(x, (0, 2, 1, 3))
    else:
        if not num_heads:
            raise OpError("RotaryEmbedding with a 3-D input needs the num_heads attribute")
        x = jnp.reshape(x, (shape[0], shape[1], num_heads, shape[2] // num_heads))
    dim = rotary_embedding_dim or x.shape[3]
    cos, sin = to_jax(cos_cache), to_jax(sin_cache)
    if position_ids is not None:
        ids = to_jax(position_ids)
        cos, sin = cos[ids], sin[ids]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    turned, kept = x[..., :dim], x[..., dim:]
    if interleaved:
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
    else:
        x1, x2 = turned[..., : dim // 2], turned[..., dim // 2 :]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        turned = jnp.reshape(jnp.stack([real, imag], axis=-1), turned.shape)
    else:
        turned = jnp.concatenate([real, imag], axis=-1)
    out = jnp.concatenate([turned, kept], axis=-1).astype(x.dtype)
    if len(shape) == 3:
        return jnp.reshape(out, shape)
    return jnp.transpose(out, (0, 2, 1, 3))
