"""Indexed reads and writes: GatherND, ScatterND, ScatterElements (and opset-9 Scatter).

Each builds one tuple of index arrays (one per data axis it addresses, batch axes as iotas) and
hands it to numpy/jax advanced indexing: ``data[idx]`` gathers, ``data.at[idx].set(u)`` scatters.
Negative indices count from the end, as the spec allows. Everything stays numpy when every input
is static (position ids and masks computed from shapes), so such chains fold at trace time.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import OpError, is_static, to_jax, xp

#: ScatterND / ScatterElements reduction -> the ``.at[]`` method (jax) or numpy ufunc.
_REDUCTIONS = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def _wrapped(index: Any, dim: Any) -> Any:
    """``index`` with negative entries counted from the end of a dim of size ``dim``."""
    m = xp(index)
    if m is np and not isinstance(dim, (int, np.integer)):
        m = jnp
        index = jnp.asarray(index)
    return m.where(index < 0, index + dim, index)


def _iota(shape: tuple[Any, ...], axis: int, m: Any) -> Any:
    """Position along ``axis`` of every element of an array of ``shape``."""
    if m is np:
        return np.indices(shape, sparse=True)[axis]
    import jax

    return jax.lax.broadcasted_iota(jnp.int64, shape, axis)


def _nd_index(data: Any, indices: Any, batch_dims: int) -> tuple[Any, ...]:
    depth = indices.shape[-1]
    if not isinstance(depth, (int, np.integer)):
        raise OpError("GatherND/ScatterND need the indices' last dim to be static")
    m = xp(data, indices)
    if m is jnp:
        indices = to_jax(indices)
    lead = tuple(indices.shape[:-1])
    batch = tuple(_iota(lead, b, m) for b in range(batch_dims))
    picked = tuple(_wrapped(indices[..., i], data.shape[batch_dims + i]) for i in range(int(depth)))
    return batch + picked


def GatherND(data: Any, indices: Any, batch_dims: int = 0) -> Any:
    index = _nd_index(data, indices, batch_dims)
    if is_static(data) and all(is_static(i) for i in index):
        return np.asarray(data[index])
    return to_jax(data)[index]


def _scatter(data: Any, index: tuple[Any, ...], updates: Any, reduction: str) -> Any:
    method = _REDUCTIONS.get(reduction)
    if method is None:
        raise OpError(f"reduction {reduction!r}: expected one of {', '.join(_REDUCTIONS)}")
    if is_static(data) and is_static(updates) and all(is_static(i) for i in index):
        out = np.array(data, copy=True)
        if method == "set":
            out[index] = updates
        else:
            ufunc = {"add": np.add, "multiply": np.multiply, "max": np.maximum, "min": np.minimum}
            ufunc[method].at(out, index, updates)
        return out
    target = to_jax(data).at[index]
    return getattr(target, method)(to_jax(updates).astype(data.dtype))


def ScatterND(data: Any, indices: Any, updates: Any, reduction: str = "none") -> Any:
    return _scatter(data, _nd_index(data, indices, 0), updates, reduction)


def ScatterElements(
    data: Any, indices: Any, updates: Any, axis: int = 0, reduction: str = "none"
) -> Any:
    rank = data.ndim
    a = axis + rank if axis < 0 else axis
    m = xp(data, indices, updates)
    if m is jnp:
        indices = to_jax(indices)
    shape = tuple(indices.shape)
    index = tuple(
        _wrapped(indices, data.shape[a]) if d == a else _iota(shape, d, m) for d in range(rank)
    )
    return _scatter(data, index, updates, reduction)


def Scatter(data: Any, indices: Any, updates: Any, axis: int = 0) -> Any:
    """Opset 9-10's name for ScatterElements (no reduction)."""
    return ScatterElements(data, indices, updates, axis=axis)
