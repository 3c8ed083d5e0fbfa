"""Reductions: Reduce*, ArgMax/ArgMin, CumSum, TopK.

Reduce* take ``axes`` as an attribute (older opsets) or an input (opset 13/18 on); both arrive
as the same ``axes`` parameter. Empty or missing axes reduce everything unless
``noop_with_empty_axes`` is set.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import OpError, optional_ints, scalar, xp
from enginekit.backends.xla.ops.common import axes as norm_axes


def _axes(data: Any, axes: Any, noop_with_empty_axes: int) -> tuple[int, ...] | None:
    """The axes to reduce, or None for "return the input unchanged"."""
    picked = optional_ints(axes, "Reduce's axes")
    if not picked:
        return None if noop_with_empty_axes else tuple(range(data.ndim))
    return tuple(norm_axes(picked, data.ndim))


def _lowest(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf
    return False if dtype == np.dtype(bool) else np.iinfo(dtype).min


def _highest(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return np.inf
    return True if dtype == np.dtype(bool) else np.iinfo(dtype).max


def ReduceSum(data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    return xp(data).sum(data, axis=picked, keepdims=bool(keepdims)).astype(data.dtype)


def ReduceMean(
    data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0
) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    return xp(data).mean(data, axis=picked, keepdims=bool(keepdims)).astype(data.dtype)


def ReduceMax(data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    lowest = _lowest(np.dtype(data.dtype))
    return xp(data).max(data, axis=picked, keepdims=bool(keepdims), initial=lowest)


def ReduceMin(data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    highest = _highest(np.dtype(data.dtype))
    return xp(data).min(data, axis=picked, keepdims=bool(keepdims), initial=highest)


def ReduceProd(
    data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0
) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    out = xp(data).prod(data, axis=picked, keepdims=bool(keepdims))
    return out if out.dtype == object else out.astype(data.dtype)


def ReduceL1(data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    return jnp.sum(jnp.abs(data), axis=picked, keepdims=bool(keepdims)).astype(data.dtype)


def ReduceL2(data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    squares = jnp.square(data.astype(jnp.float64 if data.dtype == jnp.float64 else jnp.float32))
    return jnp.sqrt(jnp.sum(squares, axis=picked, keepdims=bool(keepdims))).astype(data.dtype)


def ReduceSumSquare(
    data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0
) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    return jnp.sum(jnp.square(data), axis=picked, keepdims=bool(keepdims)).astype(data.dtype)


def ReduceLogSum(
    data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0
) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    return jnp.log(jnp.sum(data, axis=picked, keepdims=bool(keepdims))).astype(data.dtype)


def ReduceLogSumExp(
    data: Any, axes: Any = None, keepdims: int = 1, noop_with_empty_axes: int = 0
) -> Any:
    picked = _axes(data, axes, noop_with_empty_axes)
    if picked is None:
        return data
    if any(data.shape[a] == 0 for a in picked):
        return jnp.full(_kept_shape(data.shape, picked, keepdims), -jnp.inf, data.dtype)
    out = jax.nn.logsumexp(data, axis=picked, keepdims=bool(keepdims))
    return out.astype(data.dtype)


def _kept_shape(shape: tuple[Any, ...], picked: tuple[int, ...], keepdims: int) -> tuple[Any, ...]:
    if keepdims:
        return tuple(1 if i in picked else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in picked)


def _arg(fn: Any, data: Any, axis: int, keepdims: int, select_last_index: int) -> Any:
    a = axis + data.ndim if axis < 0 else axis
    if select_last_index:
        flipped = jnp.flip(data, axis=a)
        index = data.shape[a] - 1 - fn(flipped, axis=a, keepdims=bool(keepdims))
    else:
        index = fn(data, axis=a, keepdims=bool(keepdims))
    return index.astype(jnp.int64)


def ArgMax(data: Any, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Any:
    return _arg(jnp.argmax, data, axis, keepdims, select_last_index)


def ArgMin(data: Any, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Any:
    return _arg(jnp.argmin, data, axis, keepdims, select_last_index)


def CumSum(x: Any, axis: Any, exclusive: int = 0, reverse: int = 0) -> Any:
    a = int(scalar(axis, "CumSum's axis"))
    a = a + x.ndim if a < 0 else a
    values = jnp.flip(x, axis=a) if reverse else x
    total = jnp.cumsum(values, axis=a, dtype=x.dtype)
    if exclusive:
        total = total - values
    return jnp.flip(total, axis=a) if reverse else total


def TopK(X: Any, K: Any, axis: int = -1, largest: int = 1, sorted: int = 1) -> Any:
    k = int(scalar(K, "TopK's K"))
    a = axis + X.ndim if axis < 0 else axis
    moved = jnp.moveaxis(X, a, -1)
    if (
        not largest
        and not jnp.issubdtype(X.dtype, jnp.signedinteger)
        and not jnp.issubdtype(X.dtype, jnp.floating)
    ):
        raise OpError("TopK largest=0 on unsigned integers is not supported")
    values, index = jax.lax.top_k(moved if largest else -moved, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, a), jnp.moveaxis(index.astype(jnp.int64), -1, a)
