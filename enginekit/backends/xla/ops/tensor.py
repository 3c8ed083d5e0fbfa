"""Shape and data-movement ONNX ops: Reshape, Transpose, Concat, Slice, Gather, Pad, Shape, ...

Shape-like inputs (Reshape's shape, Slice's starts, Pad's pads, ...) must be static; the ops
compute in numpy whenever every input is static, and keep symbolic dims (``batch``) symbolic.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from onnx import numpy_helper

from enginekit.backends.xla.ops.common import (
    BIG,
    OpError,
    axis,
    ints,
    is_small,
    is_static,
    optional_ints,
    scalar,
    shape_array,
    size_of,
    static,
    to_jax,
    xp,
)


def _all_int(dims: Any) -> bool:
    return all(isinstance(d, (int, np.integer)) for d in dims)


def Shape(data: Any, start: int = 0, end: int | None = None) -> Any:
    dims = list(data.shape)
    rank = len(dims)
    lo = min(max(start + rank if start < 0 else start, 0), rank)
    hi = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return shape_array(dims[lo:hi])


def Size(data: Any) -> Any:
    total = size_of(data.shape)
    return np.asarray(total, dtype=np.int64 if isinstance(total, int) else object)


def Reshape(data: Any, shape: Any, allowzero: int = 0) -> Any:
    target = ints(shape, "Reshape's shape")
    if not allowzero:
        target = [
            data.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(target)
        ]
    if is_static(data) and _all_int(target):
        return np.reshape(data, target)
    return jnp.reshape(to_jax(data), tuple(target))


def Flatten(input: Any, axis: int = 1) -> Any:
    rank = input.ndim
    a = axis + rank if axis < 0 else axis
    if not 0 <= a <= rank:
        raise OpError(f"Flatten axis {axis} is out of range for rank {rank}")
    dims = (size_of(input.shape[:a]), size_of(input.shape[a:]))
    return Reshape(input, shape_array(dims), allowzero=1)


def Transpose(data: Any, perm: list[int] | None = None) -> Any:
    order = tuple(reversed(range(data.ndim))) if perm is None else tuple(perm)
    return xp(data).transpose(data, order)


def Squeeze(data: Any, axes: Any = None) -> Any:
    rank = data.ndim
    if axes is None:
        picked = [i for i, d in enumerate(data.shape) if isinstance(d, int) and d == 1]
    else:
        picked = [axis(a, rank) for a in ints(axes, "Squeeze's axes")]
    return xp(data).squeeze(data, axis=tuple(picked))


def Unsqueeze(data: Any, axes: Any) -> Any:
    wanted = ints(axes, "Unsqueeze's axes")
    rank = data.ndim + len(wanted)
    return xp(data).expand_dims(data, tuple(sorted(axis(a, rank) for a in wanted)))


def Concat(*inputs: Any, axis: int) -> Any:
    rank = inputs[0].ndim
    a = axis + rank if axis < 0 else axis
    return xp(*inputs).concatenate(inputs, axis=a)


def Split(input: Any, split: Any = None, axis: int = 0, num_outputs: int | None = None) -> Any:
    a = axis + input.ndim if axis < 0 else axis
    dim = input.shape[a]
    if split is not None:
        sizes = ints(split, "Split's split")
    else:
        if num_outputs is None:
            raise OpError("Split needs split sizes or num_outputs")
        if not isinstance(dim, int):
            return tuple(jnp.split(input, num_outputs, axis=a))
        chunk = -(-dim // num_outputs)
        sizes = [chunk] * (num_outputs - 1) + [dim - chunk * (num_outputs - 1)]
    offsets = np.cumsum(sizes)[:-1].tolist()
    return tuple(xp(input).split(input, offsets, axis=a))


def _slice(start: int, end: int, step: int, dim: Any) -> slice:
    # ONNX's clamping rules are Python's slicing rules; only symbolic dims need sentinels mapped.
    if isinstance(dim, int) and isinstance(start, int) and isinstance(end, int):
        lo, hi, st = slice(start, end, step).indices(dim)
        return slice(lo, None if hi < 0 else hi, st)
    if step > 0:
        return slice(None if start <= -BIG else start, None if end >= BIG else end, step)
    return slice(None if start >= BIG else start, None if end <= -BIG else end, step)


def Slice(data: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> Any:
    begin = ints(starts, "Slice's starts")
    stop = ints(ends, "Slice's ends")
    picked = optional_ints(axes, "Slice's axes") or list(range(len(begin)))
    stride = optional_ints(steps, "Slice's steps") or [1] * len(begin)
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(begin, stop, picked, stride):
        if st == 0:
            raise OpError("Slice step 0 is not allowed")
        a = axis(a, data.ndim)
        index[a] = _slice(s, e, st, data.shape[a])
    bounds = [b for i in index for b in (i.start, i.stop, i.step)]
    if is_static(data) and not _all_int(b for b in bounds if b is not None):
        data = jnp.asarray(data)  # numpy cannot slice to a symbolic bound (``:seq``)
    return data[tuple(index)]


def Gather(data: Any, indices: Any, axis: int = 0) -> Any:
    a = axis + data.ndim if axis < 0 else axis
    if is_static(data) and is_static(indices):
        return np.take(data, indices, axis=a)
    dim = data.shape[a]
    if is_static(indices) and indices.ndim == 0 and isinstance(dim, int):
        i = int(indices)
        return jax.lax.index_in_dim(to_jax(data), i + dim if i < 0 else i, a, keepdims=False)
    index = jnp.where(indices < 0, indices + dim, indices) if not is_static(indices) else indices
    if is_static(index):
        index = np.where(index < 0, index + dim, index)
    return jnp.take(to_jax(data), index, axis=a, mode="clip")


def GatherElements(data: Any, indices: Any, axis: int = 0) -> Any:
    a = axis + data.ndim if axis < 0 else axis
    index = xp(indices).where(indices < 0, indices + data.shape[a], indices)
    return jnp.take_along_axis(data, index, axis=a, mode="clip")


def _broadcast_dims(have: tuple[Any, ...], want: list[Any]) -> list[Any]:
    rank = max(len(have), len(want))
    a = [1] * (rank - len(have)) + list(have)
    b = [1] * (rank - len(want)) + list(want)
    return [y if isinstance(x, int) and x == 1 else x for x, y in zip(a, b)]


def Expand(input: Any, shape: Any) -> Any:
    dims = _broadcast_dims(tuple(input.shape), ints(shape, "Expand's shape"))
    if is_static(input) and is_small(dims):
        return np.broadcast_to(input, dims).copy()
    return jnp.broadcast_to(to_jax(input), tuple(dims))


def Tile(input: Any, repeats: Any) -> Any:
    reps = ints(repeats, "Tile's repeats")
    if is_static(input) and is_small([size_of(input.shape) * size_of(reps)]):
        return np.tile(input, reps)
    return jnp.tile(to_jax(input), reps)


def Pad(
    data: Any,
    pads: Any = None,
    constant_value: Any = None,
    axes: Any = None,
    mode: str = "constant",
    value: float = 0.0,
) -> Any:
    widths_flat = ints(pads, "Pad's pads")
    rank = data.ndim
    picked = (
        [axis(a, rank) for a in ints(axes, "Pad's axes")] if axes is not None else list(range(rank))
    )
    n = len(picked)
    widths = [(0, 0)] * rank
    for i, a in enumerate(picked):
        widths[a] = (widths_flat[i], widths_flat[i + n])
    x = to_jax(data)
    if mode == "constant":
        fill = value if constant_value is None else xp(constant_value).reshape(constant_value, ())
        config = [(lo, hi, 0) for lo, hi in widths]
        return jax.lax.pad(x, jnp.asarray(fill).astype(x.dtype), config)
    if mode not in ("reflect", "edge", "wrap"):
        raise OpError(f"Pad mode {mode!r}: expected constant, reflect, edge or wrap")
    crop = tuple(slice(-lo if lo < 0 else 0, hi if hi < 0 else None) for lo, hi in widths)
    grow = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    return jnp.pad(x[crop], grow, mode=mode)


def ConstantOfShape(input: Any, value: Any = None) -> Any:
    dims = ints(input, "ConstantOfShape's input")
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value)
    if is_small(dims):
        return np.full(dims, fill.reshape(-1)[0], dtype=fill.dtype)
    return jnp.full(tuple(dims), fill.reshape(-1)[0], dtype=fill.dtype)


def Range(start: Any, limit: Any, delta: Any, stash_type: int = 1) -> Any:
    first = static(start, "Range's start").reshape(())
    step = static(delta, "Range's delta").reshape(())
    end = static(limit, "Range's limit").reshape(())
    dtype = first.dtype if first.dtype != object else np.dtype(np.int64)
    if end.dtype != object and first.dtype != object:
        count = max(math.ceil((end.item() - first.item()) / step.item()), 0)
        if is_small([count]):
            return (first + np.arange(count, dtype=dtype) * step).astype(dtype)
        return (first + jnp.arange(count, dtype=dtype) * step).astype(dtype)
    lo, hi, st = first.item(), end.item(), int(step.item())
    if st <= 0:
        raise OpError("Range over a symbolic limit needs a positive delta")
    count = (hi - lo + st - 1) // st
    return lo + jnp.arange(count, dtype=dtype) * st


def Constant(
    value: Any = None,
    value_float: float | None = None,
    value_floats: list[float] | None = None,
    value_int: int | None = None,
    value_ints: list[int] | None = None,
    value_string: str | None = None,
    value_strings: list[str] | None = None,
    sparse_value: Any = None,
) -> Any:
    if value is not None:
        return np.asarray(value)
    if value_float is not None:
        return np.asarray(value_float, dtype=np.float32)
    if value_floats is not None:
        return np.asarray(value_floats, dtype=np.float32)
    if value_int is not None:
        return np.asarray(value_int, dtype=np.int64)
    if value_ints is not None:
        return np.asarray(value_ints, dtype=np.int64)
    if sparse_value is not None:
        return _dense(sparse_value)
    raise OpError("Constant of strings is not supported by the XLA backend")


def _dense(sparse: Any) -> np.ndarray:
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices)
    dense = np.zeros(int(np.prod(sparse.dims)), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(indices.T, tuple(sparse.dims))
    dense[flat] = values
    return dense.reshape(tuple(sparse.dims))


def Trilu(input: Any, k: Any = None, upper: int = 1) -> Any:
    diagonal = 0 if k is None else int(scalar(k, "Trilu's k"))
    m = xp(input)
    return m.triu(input, diagonal) if upper else m.tril(input, diagonal)


def DepthToSpace(input: Any, blocksize: int, mode: str = "DCR") -> Any:
    n, c, h, w = input.shape
    b = blocksize
    if mode == "DCR":
        x = jnp.reshape(input, (n, b, b, c // (b * b), h, w))
        x = jnp.transpose(x, (0, 3, 4, 1, 5, 2))
    else:
        x = jnp.reshape(input, (n, c // (b * b), b, b, h, w))
        x = jnp.transpose(x, (0, 1, 4, 2, 5, 3))
    return jnp.reshape(x, (n, c // (b * b), h * b, w * b))


def SpaceToDepth(input: Any, blocksize: int, mode: str = "DCR") -> Any:
    n, c, h, w = input.shape
    b = blocksize
    x = jnp.reshape(input, (n, c, h // b, b, w // b, b))
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    x = jnp.transpose(x, order)
    return jnp.reshape(x, (n, c * b * b, h // b, w // b))


def EyeLike(input: Any, dtype: int | None = None, k: int = 0) -> Any:
    from enginekit.backends.xla.ops.common import np_dtype

    out = np.dtype(input.dtype) if dtype is None else np_dtype(dtype)
    rows, cols = input.shape
    return jnp.eye(rows, cols, k, dtype=out)
