"""Smaller ONNX ops real exports and the ONNX test data use: Shrink, Swish, bitwise ops,
CumProd, the newer normalizations (GroupNormalization, RMSNormalization,
MeanVarianceNormalization), OneHot and ReverseSequence.

One function per op, inputs positional, attributes as keywords with the spec's defaults.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from enginekit.backends.xla.ops.common import OpError, scalar, to_jax, xp


def Shrink(input: Any, bias: float = 0.0, lambd: float = 0.5) -> Any:
    x = to_jax(input)
    shift = jnp.asarray(bias).astype(x.dtype)
    return jnp.where(x < -lambd, x + shift, jnp.where(x > lambd, x - shift, jnp.zeros_like(x)))


def Swish(X: Any, alpha: float = 1.0) -> Any:
    return X * jax.nn.sigmoid(jnp.asarray(alpha, X.dtype) * X)


def BitShift(X: Any, Y: Any, direction: str = "") -> Any:
    if direction == "LEFT":
        return xp(X, Y).left_shift(X, Y)
    if direction == "RIGHT":
        return xp(X, Y).right_shift(X, Y)
    raise OpError(f"BitShift direction {direction!r}: expected LEFT or RIGHT")


def BitwiseAnd(A: Any, B: Any) -> Any:
    return xp(A, B).bitwise_and(A, B)


def BitwiseOr(A: Any, B: Any) -> Any:
    return xp(A, B).bitwise_or(A, B)


def BitwiseXor(A: Any, B: Any) -> Any:
    return xp(A, B).bitwise_xor(A, B)


def BitwiseNot(X: Any) -> Any:
    return xp(X).bitwise_not(X)


def CumProd(x: Any, axis: Any, exclusive: int = 0, reverse: int = 0) -> Any:
    a = int(scalar(axis, "CumProd's axis"))
    a = a + x.ndim if a < 0 else a
    values = jnp.flip(x, axis=a) if reverse else to_jax(x)
    if exclusive:
        ones = jnp.ones_like(jax.lax.slice_in_dim(values, 0, 1, axis=a))
        values = jnp.concatenate([ones, jax.lax.slice_in_dim(values, 0, -1, axis=a)], axis=a)
    total = jnp.cumprod(values, axis=a, dtype=x.dtype)
    return jnp.flip(total, axis=a) if reverse else total


def MeanVarianceNormalization(X: Any, axes: list[int] | None = None) -> Any:
    picked = tuple(axes) if axes is not None else (0, 2, 3)
    mean = jnp.mean(X, axis=picked, keepdims=True)
    variance = jnp.mean(X * X, axis=picked, keepdims=True) - mean * mean
    return (X - mean) / (jnp.sqrt(variance) + jnp.asarray(1e-9, X.dtype))


def GroupNormalization(
    X: Any, scale: Any, bias: Any, epsilon: float = 1e-5, num_groups: int = 0, stash_type: int = 1
) -> Any:
    n, c = X.shape[0], X.shape[1]
    if not num_groups or c % num_groups:
        raise OpError(f"GroupNormalization: {c} channels do not split into {num_groups} groups")
    x = to_jax(X)
    work = x.astype(jnp.float32) if stash_type == 1 else x
    grouped = work.reshape((n, num_groups, -1))
    mean = jnp.mean(grouped, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(grouped - mean), axis=-1, keepdims=True)
    normed = ((grouped - mean) / jnp.sqrt(var + epsilon)).reshape(x.shape).astype(x.dtype)
    if scale.shape[0] == num_groups and num_groups != c:  # opset 18: one scale per group
        scale = jnp.repeat(jnp.asarray(scale), c // num_groups)
        bias = jnp.repeat(jnp.asarray(bias), c // num_groups)
    shape = (1, c) + (1,) * (X.ndim - 2)
    return normed * jnp.reshape(scale, shape) + jnp.reshape(bias, shape)


def RMSNormalization(
    X: Any, scale: Any, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1
) -> Any:
    a = axis + X.ndim if axis < 0 else axis
    x = to_jax(X)
    work = x.astype(jnp.float32) if stash_type == 1 else x
    mean_square = jnp.mean(jnp.square(work), axis=tuple(range(a, X.ndim)), keepdims=True)
    return (work / jnp.sqrt(mean_square + epsilon)).astype(x.dtype) * scale


def OneHot(indices: Any, depth: Any, values: Any, axis: int = -1) -> Any:
    size = int(scalar(depth, "OneHot's depth"))
    index = to_jax(indices)
    index = jnp.where(index < 0, index + size, index)
    rank = index.ndim + 1
    a = axis + rank if axis < 0 else axis
    hot = jnp.expand_dims(index, a) == jax.lax.broadcasted_iota(
        index.dtype, (*index.shape[:a], size, *index.shape[a:]), a
    )
    off_on = to_jax(values)
    return jnp.where(hot, off_on[1], off_on[0])


def ReverseSequence(input: Any, sequence_lens: Any, batch_axis: int = 1, time_axis: int = 0) -> Any:
    x = to_jax(input)
    steps = jax.lax.broadcasted_iota(jnp.int64, x.shape, time_axis)
    lens = jnp.asarray(sequence_lens).astype(jnp.int64)
    shape = [1] * x.ndim
    shape[batch_axis] = -1
    lens = lens.reshape(shape)
    source = jnp.where(steps < lens, lens - 1 - steps, steps)
    return jnp.take_along_axis(x, source, axis=time_axis)
