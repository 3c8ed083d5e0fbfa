"""Smaller ops of the newer opsets and the ONNX test data: BitCast, CenterCropPad, Col2Im,
MaxUnpool, TensorScatter, Det, and the integer matmuls (MatMulInteger, QLinearMatMul).

One function per op, inputs positional, attributes as keywords with the spec's defaults.
Index arithmetic that depends only on static shapes is done once in numpy at trace time.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import OpError, axes, ints, is_static, np_dtype, to_jax


def BitCast(input: Any, to: int = 0) -> Any:
    target = np_dtype(to)
    if np.dtype(input.dtype).itemsize != target.itemsize:
        raise OpError(
            f"BitCast from {input.dtype} to {target}: the types must have the same bit width"
        )
    if is_static(input):
        return np.asarray(input).view(target)
    if input.dtype == jnp.bool_ or target == np.bool_:  # XLA bitcasts no bools: 1 byte, 0 or 1
        small = input.astype(jnp.uint8) if input.dtype == jnp.bool_ else input
        small = jax.lax.bitcast_convert_type(small, jnp.uint8)
        return small != 0 if target == np.bool_ else small.astype(target)
    return jax.lax.bitcast_convert_type(input, target)


def CenterCropPad(input_data: Any, shape: Any, axes: list[int] | None = None) -> Any:
    x = to_jax(input_data)
    picked = list(range(x.ndim)) if axes is None else [a % x.ndim for a in axes]
    wanted = ints(shape, "CenterCropPad's shape")
    for a, size in zip(picked, wanted):
        dim = x.shape[a]
        if size < dim:  # crop: the extra element of an odd difference goes off the end
            start = (dim - size) // 2
            x = jax.lax.slice_in_dim(x, start, start + size, axis=a)
        elif size > dim:  # pad: likewise, the extra zero goes at the end
            before = (size - dim) // 2
            pads = [(0, 0)] * x.ndim
            pads[a] = (before, size - dim - before)
            x = jnp.pad(x, pads)
    return x


def Col2Im(
    input: Any,
    image_shape: Any,
    block_shape: Any,
    dilations: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> Any:
    """Sums the sliding blocks of ``input`` [N, C * prod(block), L] back into an image
    [N, C, *image_shape] (torch's ``fold``)."""
    image = ints(image_shape, "Col2Im's image_shape")
    block = ints(block_shape, "Col2Im's block_shape")
    n = len(image)
    dil = dilations or [1] * n
    stride = strides or [1] * n
    pad = pads or [0] * (2 * n)
    counts = [
        (image[d] + pad[d] + pad[d + n] - dil[d] * (block[d] - 1) - 1) // stride[d] + 1
        for d in range(n)
    ]
    # Target flat pixel of every (kernel offset, block) pair; out-of-image ones go to a dump slot.
    pixels = math.prod(image)
    target = np.full((math.prod(block), math.prod(counts)), pixels, np.int64)
    for k, offset in enumerate(itertools.product(*(range(b) for b in block))):
        for j, where in enumerate(itertools.product(*(range(c) for c in counts))):
            pos = [where[d] * stride[d] - pad[d] + offset[d] * dil[d] for d in range(n)]
            if all(0 <= pos[d] < image[d] for d in range(n)):
                target[k, j] = np.ravel_multi_index(pos, image)
    x = to_jax(input)
    batch, channels = x.shape[0], x.shape[1] // math.prod(block)
    cols = jnp.reshape(x, (batch, channels, -1))
    out = jnp.zeros((batch, channels, pixels + 1), x.dtype)
    out = out.at[:, :, target.reshape(-1)].add(cols)
    return jnp.reshape(out[:, :, :pixels], (batch, channels, *image))


def MaxUnpool(
    X: Any,
    I: Any,  # noqa: E741 - the spec's name
    output_shape: Any = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> Any:
    if not kernel_shape:
        raise OpError("MaxUnpool needs the kernel_shape attribute")
    n = len(kernel_shape)
    stride = strides or [1] * n
    pad = pads or [0] * (2 * n)
    x = to_jax(X)
    inferred = [x.shape[0], x.shape[1]] + [
        (x.shape[d + 2] - 1) * stride[d] - (pad[d] + pad[d + n]) + kernel_shape[d] for d in range(n)
    ]
    flat = jnp.zeros((math.prod(inferred),), x.dtype)
    flat = flat.at[jnp.reshape(to_jax(I), (-1,))].set(jnp.reshape(x, (-1,)))
    y = jnp.reshape(flat, inferred)
    if output_shape is None:
        return y
    wanted = ints(output_shape, "MaxUnpool's output_shape")
    return jnp.pad(y, [(0, w - h) for w, h in zip(wanted, inferred)])


def TensorScatter(
    past_cache: Any, update: Any, write_indices: Any = None, axis: int = -2, mode: str = "linear"
) -> Any:
    """Writes ``update`` into the cache along ``axis`` from each batch entry's write index
    (wrapping around in ``circular`` mode)."""
    if mode not in ("linear", "circular"):
        raise OpError(f"TensorScatter mode {mode!r}: expected linear or circular")
    cache, u = to_jax(past_cache), to_jax(update)
    a = axes([axis], cache.ndim)[0]
    batch = cache.shape[0]
    start = (
        jnp.zeros((batch,), jnp.int64)
        if write_indices is None
        else to_jax(write_indices).astype(jnp.int64)
    )
    shape = u.shape
    index = []
    for d in range(cache.ndim):
        if d == a:
            pos = jax.lax.broadcasted_iota(jnp.int64, shape, d)
            pos = pos + jnp.reshape(start, (batch,) + (1,) * (cache.ndim - 1))
            if mode == "circular":
                pos = pos % cache.shape[a]
            index.append(pos)
        else:
            index.append(jax.lax.broadcasted_iota(jnp.int64, shape, d))
    return cache.at[tuple(index)].set(u, mode="drop")


def Det(X: Any) -> Any:
    return jnp.linalg.det(to_jax(X))


def _minus_zero_point(x: Any, zero_point: Any) -> Any:
    value = to_jax(x).astype(jnp.int32)
    if zero_point is None:
        return value
    return value - to_jax(zero_point).astype(jnp.int32)


def MatMulInteger(A: Any, B: Any, a_zero_point: Any = None, b_zero_point: Any = None) -> Any:
    a_zp = a_zero_point
    if a_zp is not None and np.ndim(a_zp) == 1 and np.shape(a_zp)[0] > 1:
        a_zp = jnp.reshape(to_jax(a_zp), (-1, 1))  # one zero point per row of A
    a = _minus_zero_point(A, a_zp)
    b = _minus_zero_point(B, b_zero_point)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


def QLinearMatMul(
    a: Any,
    a_scale: Any,
    a_zero_point: Any,
    b: Any,
    b_scale: Any,
    b_zero_point: Any,
    y_scale: Any,
    y_zero_point: Any,
) -> Any:
    product = jnp.matmul(
        _minus_zero_point(a, a_zero_point),
        _minus_zero_point(b, b_zero_point),
        preferred_element_type=jnp.int32,
    )
    # The combined scale is formed in the scales' own type, as the reference does.
    ratio = to_jax(a_scale) * to_jax(b_scale) / to_jax(y_scale)
    wide = jnp.result_type(float)  # float64 where x64 is on (the lowering turns it on)
    out = product.astype(wide) * ratio.astype(wide)
    out_type = (y_zero_point if y_zero_point is not None else a).dtype
    if y_zero_point is not None:
        out = out + to_jax(y_zero_point).astype(wide)
    info = jnp.iinfo(out_type)
    return jnp.clip(jnp.round(out), info.min, info.max).astype(out_type)


def Compress(input: Any, condition: Any, axis: int | None = None) -> Any:
    """Needs ``condition`` known when the model is built: it decides the output's shape."""
    if not is_static(condition):
        raise OpError(
            "Compress's condition is computed from the inputs at run time; it decides the "
            "output's shape, which XLA needs fixed to compile"
        )
    keep = np.ravel(np.asarray(condition)).astype(bool)
    x = to_jax(input) if not is_static(input) else np.asarray(input)
    m = np if is_static(input) else jnp
    if axis is None:
        flat = m.reshape(x, (-1,))
        picked = np.nonzero(keep[: flat.shape[0]])[0]
        return flat[picked]
    a = axes([axis], x.ndim)[0]
    picked = np.nonzero(keep[: x.shape[a]])[0]
    return m.take(x, picked, axis=a)


def _tfidf_grams(
    pool: list[int], ngram_counts: list[int], low: int, high: int
) -> list[tuple[int, list[int]]]:
    """(index among the pool's n-grams, the n-gram) for every pool n-gram of a counted size."""
    grams: list[tuple[int, list[int]]] = []
    position = 0
    for size, start in enumerate(ngram_counts, start=1):
        end = ngram_counts[size] if size < len(ngram_counts) else len(pool)
        for at in range(start, end, size):
            if low <= size <= high:
                grams.append((position, pool[at : at + size]))
            position += 1
    return grams


def TfIdfVectorizer(
    X: Any,
    max_gram_length: int = 0,
    max_skip_count: int = 0,
    min_gram_length: int = 0,
    mode: str = "",
    ngram_counts: list[int] | None = None,
    ngram_indexes: list[int] | None = None,
    pool_int64s: list[int] | None = None,
    pool_strings: list[str] | None = None,
    weights: list[float] | None = None,
) -> Any:
    """Counts of the pool's n-grams (with up to ``max_skip_count`` skipped items between
    members) per row; unigrams are counted once, not once per skip distance."""
    if pool_strings or not pool_int64s:
        raise OpError("TfIdfVectorizer needs pool_int64s (string pools are not supported)")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise OpError(f"TfIdfVectorizer mode {mode!r}: expected TF, IDF or TFIDF")
    indexes = list(ngram_indexes or [])
    size = max(indexes) + 1
    x = to_jax(X)
    rows = x if x.ndim == 2 else x[None, :]
    length = rows.shape[1]
    counts = [jnp.zeros((rows.shape[0],), jnp.float32) for _ in range(size)]
    grams = _tfidf_grams(
        list(pool_int64s), list(ngram_counts or [0]), min_gram_length, max_gram_length
    )
    for position, gram in grams:
        for step in range(1, (max_skip_count + 1 if len(gram) > 1 else 1) + 1):
            starts = length - (len(gram) - 1) * step
            if starts <= 0:
                continue
            hit: Any = True
            for j, item in enumerate(gram):
                hit = hit & (rows[:, j * step : j * step + starts] == item)
            slot = indexes[position]
            counts[slot] = counts[slot] + jnp.sum(hit, axis=1).astype(jnp.float32)
    tf = jnp.stack(counts, axis=1)
    w = jnp.asarray(weights, jnp.float32) if weights else None
    if mode == "IDF":
        out = jnp.where(tf > 0, w if w is not None else 1.0, 0.0)
    elif mode == "TFIDF" and w is not None:
        out = tf * w
    else:
        out = tf
    return out.astype(jnp.float32) if x.ndim == 2 else out[0].astype(jnp.float32)
