"""Pooling ONNX ops: MaxPool, AveragePool, LpPool and the global pools, as XLA reduce_window.

Like the convolutions they take ``channels_last``: windows then cover dims 1..-2 of an NHWC
activation instead of dims 2.. of an NCHW one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import (
    OpError,
    Pads,
    explicit_pads,
    spatial_axes,
    spatial_dims,
)


def _pool_pads(
    auto_pad: str,
    pads: Sequence[int] | None,
    spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    ceil_mode: int,
) -> tuple[Pads, list[int]]:
    """Explicit (begin, end) pads, and the extra end padding ceil_mode's last window needs."""
    explicit = explicit_pads(auto_pad, pads, spatial, kernel, strides, dilations)
    extra = []
    for (lo, hi), size, k, s, d in zip(explicit, spatial, kernel, strides, dilations):
        if not isinstance(size, int):
            raise OpError(f"pooling needs static spatial dims, got {size}")
        window = (k - 1) * d + 1
        span = size + lo + hi - window
        out = span // s + 1
        if ceil_mode:
            out = -(-span // s) + 1
            if (out - 1) * s >= size + lo:  # the last window must start inside the input
                out -= 1
        extra.append(max((out - 1) * s + window - (size + lo + hi), 0))
    return explicit, extra


def _window(rank: int, values: Sequence[Any], fill: Any, channels_last: bool) -> tuple[Any, ...]:
    if channels_last:
        return (fill, *values, fill)
    return (fill, fill, *values)


def _reduce_window(
    x: Any,
    init: Any,
    op: Any,
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    padding: Pads,
    channels_last: bool,
) -> Any:
    rank = x.ndim
    return jax.lax.reduce_window(
        x,
        init,
        op,
        _window(rank, kernel, 1, channels_last),
        _window(rank, strides, 1, channels_last),
        _window(rank, padding, (0, 0), channels_last),
        window_dilation=_window(rank, dilations, 1, channels_last),
    )


def _pool_setup(
    X: Any,
    auto_pad: str,
    ceil_mode: int,
    dilations: list[int] | None,
    kernel_shape: list[int],
    pads: list[int] | None,
    strides: list[int] | None,
    channels_last: bool,
) -> tuple[list[int], list[int], Pads, list[int]]:
    n = X.ndim - 2
    strides = strides or [1] * n
    dilations = dilations or [1] * n
    explicit, extra = _pool_pads(
        auto_pad, pads, spatial_dims(X, channels_last), kernel_shape, strides, dilations, ceil_mode
    )
    return strides, dilations, explicit, extra


def MaxPool(
    X: Any,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    storage_order: int = 0,
    strides: list[int] | None = None,
    *,
    channels_last: bool = False,
) -> Any:
    if kernel_shape is None:
        raise OpError("MaxPool needs kernel_shape")
    strides, dilations, explicit, extra = _pool_setup(
        X, auto_pad, ceil_mode, dilations, kernel_shape, pads, strides, channels_last
    )
    padding = [(lo, hi + e) for (lo, hi), e in zip(explicit, extra)]
    if jnp.issubdtype(X.dtype, jnp.floating):
        init = jnp.array(-jnp.inf, X.dtype)
    else:
        init = jnp.array(jnp.iinfo(X.dtype).min, X.dtype)
    return _reduce_window(
        X, init, jax.lax.max, kernel_shape, strides, dilations, padding, channels_last
    )


def _window_counts(
    X: Any,
    kernel: list[int],
    strides: list[int],
    dilations: list[int],
    explicit: Pads,
    extra: list[int],
    include_pad: bool,
    channels_last: bool,
) -> Any:
    """How many real (or real + explicitly padded) elements each window covers."""
    spatial = spatial_dims(X, channels_last)
    ones = np.ones(spatial, np.float32)
    if include_pad:
        ones = np.pad(ones, explicit, constant_values=1)
        padding = [(0, e) for e in extra]
    else:
        padding = [(lo, hi + e) for (lo, hi), e in zip(explicit, extra)]
    shape = (1, *ones.shape, 1) if channels_last else (1, 1, *ones.shape)
    counts = _reduce_window(
        jnp.asarray(ones.reshape(shape)),
        jnp.array(0, jnp.float32),
        jax.lax.add,
        kernel,
        strides,
        dilations,
        padding,
        channels_last,
    )
    return counts


def AveragePool(
    X: Any,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
    *,
    channels_last: bool = False,
) -> Any:
    if kernel_shape is None:
        raise OpError("AveragePool needs kernel_shape")
    strides, dilations, explicit, extra = _pool_setup(
        X, auto_pad, ceil_mode, dilations, kernel_shape, pads, strides, channels_last
    )
    padding = [(lo, hi + e) for (lo, hi), e in zip(explicit, extra)]
    zero = jnp.array(0, X.dtype)
    sums = _reduce_window(
        X, zero, jax.lax.add, kernel_shape, strides, dilations, padding, channels_last
    )
    if not any(lo or hi for lo, hi in padding):
        return sums / np.prod(kernel_shape).astype(X.dtype)
    counts = _window_counts(
        X, kernel_shape, strides, dilations, explicit, extra, bool(count_include_pad), channels_last
    )
    return (sums / counts).astype(X.dtype)


def LpPool(
    X: Any,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: list[int] | None = None,
    kernel_shape: list[int] | None = None,
    p: int = 2,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
    *,
    channels_last: bool = False,
) -> Any:
    if kernel_shape is None:
        raise OpError("LpPool needs kernel_shape")
    strides, dilations, explicit, extra = _pool_setup(
        X, auto_pad, ceil_mode, dilations, kernel_shape, pads, strides, channels_last
    )
    padding = [(lo, hi + e) for (lo, hi), e in zip(explicit, extra)]
    powered = jnp.abs(X) ** p
    zero = jnp.array(0, X.dtype)
    sums = _reduce_window(
        powered, zero, jax.lax.add, kernel_shape, strides, dilations, padding, channels_last
    )
    return (sums ** (1.0 / p)).astype(X.dtype)


def GlobalAveragePool(X: Any, *, channels_last: bool = False) -> Any:
    return jnp.mean(X, axis=spatial_axes(X.ndim, channels_last), keepdims=True)


def GlobalMaxPool(X: Any, *, channels_last: bool = False) -> Any:
    return jnp.max(X, axis=spatial_axes(X.ndim, channels_last), keepdims=True)
