"""Neural-network ONNX ops: convolutions, pools, normalizations, Gemm/MatMul, Softmax, Dropout.

Ops that see a channel dim take ``channels_last``: the lowering sets it when the activation is
held channels-last (NHWC). Conv then also receives its kernel spatial-first (HWIO) and
ConvTranspose a ready-made forward kernel (see ``layout.py``): weights are rearranged once
at build time, never per call.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import (
    OpError,
    axis,
    channel_axis,
    explicit_pads,
    per_channel,
    scalar,
    spatial_axes,
    spatial_dims,
    xp,
)


def _dimension_numbers(rank: int, channels_last: bool) -> jax.lax.ConvDimensionNumbers:
    n = rank - 2
    if channels_last:
        act = (0, rank - 1, *range(1, rank - 1))
        kernel = (n + 1, n, *range(n))
    else:
        act = tuple(range(rank))
        kernel = tuple(range(rank))
    return jax.lax.ConvDimensionNumbers(act, kernel, act)


def _kernelspatial_dims(W: Any, n: int, channels_last: bool) -> tuple[int, ...]:
    return tuple(W.shape[:n]) if channels_last else tuple(W.shape[2:])


def Conv(
    X: Any,
    W: Any,
    B: Any = None,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
    *,
    channels_last: bool = False,
) -> Any:
    n = X.ndim - 2
    kernel = _kernelspatial_dims(W, n, channels_last)
    strides = strides or [1] * n
    dilations = dilations or [1] * n
    spatial = spatial_dims(X, channels_last)
    padding = explicit_pads(auto_pad, pads, spatial, kernel, strides, dilations)
    if group == 1 and channels_last and _pointwise(kernel, padding):
        y = _conv_pointwise(X, W, strides)
    elif group == 1 and _window_smaller_than_kernel(spatial, kernel):
        y = _conv_by_windows(X, W, padding, strides, dilations, channels_last)
    else:
        y = jax.lax.conv_general_dilated(
            X,
            W,
            window_strides=strides,
            padding=padding,
            rhs_dilation=dilations,
            dimension_numbers=_dimension_numbers(X.ndim, channels_last),
            feature_group_count=group,
        )
    if B is not None:
        y = y + per_channel(B, y.ndim, channels_last)
    return y


def _window_smaller_than_kernel(spatial: tuple[Any, ...], kernel: Sequence[int]) -> bool:
    """XLA's algebraic simplifier swaps a convolution's operands when the input's spatial
    size is below the kernel's (a 3x3 conv on ResNet's last 2x2 stage at a small input);
    XLA:CPU then runs the swapped form ~30x slower than the same work as a matmul."""
    if not all(isinstance(d, int) for d in spatial):
        return False
    return math.prod(spatial) < math.prod(kernel)


def _pointwise(kernel: Sequence[int], padding: list[tuple[int, int]]) -> bool:
    """A 1x1 convolution without padding: a matmul over the channels of every pixel."""
    return all(k == 1 for k in kernel) and all(p == (0, 0) for p in padding)


def _conv_pointwise(X: Any, W: Any, strides: Sequence[int]) -> Any:
    """A channels-last 1x1 convolution as one dot over the channel axis (strided pixels
    sliced first): XLA:CPU runs it as a plain matmul, where as a convolution it goes through
    the convolution emitter (measured on ResNet-18's downsampling shortcuts)."""
    x = X
    if any(s != 1 for s in strides):
        x = jax.lax.slice(x, (0,) * x.ndim, x.shape, (1, *strides, 1))
    w = W.reshape(W.shape[-2], W.shape[-1])  # [1, 1, Cin, Cout] -> [Cin, Cout]: a bitcast
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _conv_by_windows(
    X: Any,
    W: Any,
    padding: list[tuple[int, int]],
    strides: list[int],
    dilations: list[int],
    channels_last: bool,
) -> Any:
    """The convolution as one matmul over the stacked kernel windows (im2col); for inputs
    smaller than the kernel, where the windows are few."""
    n = X.ndim - 2
    x = X if channels_last else jnp.moveaxis(X, 1, -1)
    kernel = W if channels_last else jnp.moveaxis(W, (0, 1), (-1, -2))  # HWIO
    x = jax.lax.pad(
        x, jnp.zeros((), x.dtype), [(0, 0, 0), *((lo, hi, 0) for lo, hi in padding), (0, 0, 0)]
    )
    size = x.shape[1:-1]
    taps = kernel.shape[:n]
    out = [(size[i] - (taps[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(n)]
    windows = []
    for offset in itertools.product(*(range(k) for k in taps)):
        start = [0, *(o * d for o, d in zip(offset, dilations)), 0]
        limit = [
            x.shape[0],
            *(st + (o - 1) * s + 1 for st, o, s in zip(start[1:-1], out, strides)),
            x.shape[-1],
        ]
        windows.append(jax.lax.slice(x, start, limit, [1, *strides, 1]))
    # Windows side by side on the channel axis, in the kernel's (taps, Cin) order, so the
    # HWIO kernel flattens to [taps * Cin, Cout] as a bitcast. (Stacked on a new axis, XLA
    # laid the stack out channel-major and transposed the whole kernel on every call.)
    patches = jnp.concatenate(windows, axis=-1)  # [N, *out, taps * Cin]
    flat = kernel.reshape(math.prod(taps) * kernel.shape[-2], kernel.shape[-1])
    y = jax.lax.dot_general(patches, flat, (((patches.ndim - 1,), (0,)), ((), ())))
    return y if channels_last else jnp.moveaxis(y, -1, 1)


def ConvTranspose(
    X: Any,
    W: Any,
    B: Any = None,
    auto_pad: str = "NOTSET",
    dilations: list[int] | None = None,
    group: int = 1,
    kernel_shape: list[int] | None = None,
    output_padding: list[int] | None = None,
    output_shape: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
    *,
    channels_last: bool = False,
) -> Any:
    # W arrives as the equivalent forward-conv kernel (flipped, groups regrouped): layout.py.
    n = X.ndim - 2
    kernel = _kernelspatial_dims(W, n, channels_last)
    spatial = spatial_dims(X, channels_last)
    strides = strides or [1] * n
    dilations = dilations or [1] * n
    extra = output_padding or [0] * n
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        wanted = (
            list(output_shape)[-n:] if output_shape else [s * x for s, x in zip(strides, spatial)]
        )
        full = [
            strides[i] * (spatial[i] - 1) + extra[i] + (kernel[i] - 1) * dilations[i] + 1
            for i in range(n)
        ]
        total = [f - w for f, w in zip(full, wanted)]
        if auto_pad == "SAME_UPPER":
            begin_end = [(t // 2, t - t // 2) for t in total]
        else:
            begin_end = [(t - t // 2, t // 2) for t in total]
    else:
        begin_end = explicit_pads(auto_pad, pads, spatial, kernel, strides, dilations)
    padding = [
        ((k - 1) * d - lo, (k - 1) * d - hi + e)
        for (lo, hi), k, d, e in zip(begin_end, kernel, dilations, extra)
    ]
    y = jax.lax.conv_general_dilated(
        X,
        W,
        window_strides=[1] * n,
        padding=padding,
        lhs_dilation=strides,
        rhs_dilation=dilations,
        dimension_numbers=_dimension_numbers(X.ndim, channels_last),
        feature_group_count=group,
    )
    if B is not None:
        y = y + per_channel(B, y.ndim, channels_last)
    return y


# -- normalization --------------------------------------------------------------------------


def BatchNormalization(
    X: Any,
    scale: Any,
    B: Any,
    input_mean: Any,
    input_var: Any,
    epsilon: float = 1e-5,
    momentum: float = 0.9,
    training_mode: int = 0,
    spatial: int = 1,
    is_test: int = 0,
    *,
    channels_last: bool = False,
) -> Any:
    if training_mode:
        return _batch_norm_training(
            X, scale, B, input_mean, input_var, epsilon, momentum, channels_last
        )
    if not spatial:
        raise OpError("BatchNormalization spatial=0 (per-activation statistics) is not supported")
    rank = X.ndim
    m = xp(scale, input_var)
    inv = scale / m.sqrt(input_var + np.asarray(epsilon, dtype=input_var.dtype))
    mean = per_channel(input_mean, rank, channels_last)
    return (X - mean) * per_channel(inv, rank, channels_last) + per_channel(B, rank, channels_last)


def _batch_norm_training(
    X: Any,
    scale: Any,
    B: Any,
    input_mean: Any,
    input_var: Any,
    epsilon: float,
    momentum: float,
    channels_last: bool,
) -> tuple[Any, Any, Any]:
    """training_mode=1 (opset 14+): normalized with the batch's own statistics; also returns the
    running mean and variance updated with them (what the spec's outputs 1 and 2 are)."""
    rank = X.ndim
    kept = channel_axis(rank, channels_last)
    over = tuple(a for a in range(rank) if a != kept)
    x = jnp.asarray(X)
    mean = jnp.mean(x, axis=over)
    var = jnp.var(x, axis=over)
    inv = scale / jnp.sqrt(var + jnp.asarray(epsilon, x.dtype))
    y = (x - per_channel(mean, rank, channels_last)) * per_channel(inv, rank, channels_last)
    y = y + per_channel(B, rank, channels_last)
    running_mean = input_mean * momentum + mean * (1 - momentum)
    running_var = input_var * momentum + var * (1 - momentum)
    return y.astype(x.dtype), running_mean.astype(x.dtype), running_var.astype(x.dtype)


def InstanceNormalization(
    input: Any, scale: Any, B: Any, epsilon: float = 1e-5, *, channels_last: bool = False
) -> Any:
    rank = input.ndim
    reduce_axes = spatial_axes(rank, channels_last)
    mean = jnp.mean(input, axis=reduce_axes, keepdims=True)
    var = jnp.mean(jnp.square(input - mean), axis=reduce_axes, keepdims=True)
    normalized = (input - mean) * jax.lax.rsqrt(var + epsilon)
    return normalized * per_channel(scale, rank, channels_last) + per_channel(
        B, rank, channels_last
    )


def LayerNormalization(
    X: Any, Scale: Any, B: Any = None, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> Any:
    rank = X.ndim
    first = axis + rank if axis < 0 else axis
    reduce_axes = tuple(range(first, rank))
    x = X.astype(jnp.float32) if stash_type == 1 and X.dtype != jnp.float64 else X
    mean = jnp.mean(x, axis=reduce_axes, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=reduce_axes, keepdims=True)
    inv_std = jax.lax.rsqrt(var + epsilon)
    y = (centered * inv_std).astype(X.dtype) * Scale
    if B is not None:
        y = y + B
    return y, mean, inv_std


def LpNormalization(input: Any, axis: int = -1, p: int = 2) -> Any:
    a = axis + input.ndim if axis < 0 else axis
    if p == 1:
        norm = jnp.sum(jnp.abs(input), axis=a, keepdims=True)
    else:
        norm = jnp.sqrt(jnp.sum(jnp.square(input), axis=a, keepdims=True))
    return jnp.where(norm == 0, 0, input / norm).astype(input.dtype)


def LRN(
    X: Any,
    size: int,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
    *,
    channels_last: bool = False,
) -> Any:
    rank = X.ndim
    c = channel_axis(rank, channels_last)
    window = [1] * rank
    window[c] = size
    padding = [(0, 0)] * rank
    padding[c] = ((size - 1) // 2, size - 1 - (size - 1) // 2)
    sums = jax.lax.reduce_window(
        jnp.square(X), jnp.array(0, X.dtype), jax.lax.add, window, [1] * rank, padding
    )
    return X / (bias + (alpha / size) * sums) ** beta


# -- dense ----------------------------------------------------------------------------------


def Gemm(
    A: Any,
    B: Any,
    C: Any = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
    broadcast: int = 0,
) -> Any:
    m = xp(A, B, C)
    a = A.T if transA else A
    b = B.T if transB else B
    y = m.matmul(a, b)
    if alpha != 1.0:
        y = y * np.asarray(alpha, dtype=A.dtype)
    if C is not None:
        y = y + (C * np.asarray(beta, dtype=C.dtype) if beta != 1.0 else C)
    return y.astype(A.dtype)


def MatMul(A: Any, B: Any) -> Any:
    return xp(A, B).matmul(A, B)


def Einsum(*Inputs: Any, equation: str) -> Any:
    return jnp.einsum(equation.replace(" ", ""), *Inputs)


# -- softmax family -------------------------------------------------------------------------


def _coerced_2d(fn: Any, x: Any, a: int) -> Any:
    """Opset < 13 semantics: flatten to 2-D at ``a``, apply along dim 1, restore the shape."""
    a = axis(a, x.ndim)
    rows = 1
    for d in x.shape[:a]:
        rows = rows * d
    flat = jnp.reshape(x, (rows, -1))
    return jnp.reshape(fn(flat, 1), x.shape)


def _hardmax(x: Any, a: int) -> Any:
    return jax.nn.one_hot(jnp.argmax(x, axis=a), x.shape[a], axis=a, dtype=x.dtype)


def Softmax(input: Any, axis: int = -1) -> Any:
    return jax.nn.softmax(input, axis=axis)


def Softmax_1(input: Any, axis: int = 1) -> Any:
    return _coerced_2d(lambda x, a: jax.nn.softmax(x, axis=a), input, axis)


def LogSoftmax(input: Any, axis: int = -1) -> Any:
    return jax.nn.log_softmax(input, axis=axis)


def LogSoftmax_1(input: Any, axis: int = 1) -> Any:
    return _coerced_2d(lambda x, a: jax.nn.log_softmax(x, axis=a), input, axis)


def Hardmax(input: Any, axis: int = -1) -> Any:
    return _hardmax(input, axis + input.ndim if axis < 0 else axis)


def Hardmax_1(input: Any, axis: int = 1) -> Any:
    return _coerced_2d(_hardmax, input, axis)


# -- inference-time no-ops ------------------------------------------------------------------


def Dropout(
    data: Any,
    ratio: Any = None,
    training_mode: Any = None,
    seed: int | None = None,
    is_test: int = 0,
) -> Any:
    if training_mode is not None and bool(scalar(training_mode, "Dropout's training_mode")):
        if ratio is None or scalar(ratio, "Dropout's ratio") != 0:
            raise OpError("Dropout in training mode (random masks) is not supported")
    return data, xp(data).ones(data.shape, dtype=bool)
