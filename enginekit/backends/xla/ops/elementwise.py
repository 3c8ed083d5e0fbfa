"""Elementwise ONNX ops: math, activations, comparisons, logic, Cast, Clip, Where.

One function per op, named after it: ONNX inputs are positional parameters, attributes are
keyword parameters with the spec's defaults. Ops that shape arithmetic runs through (Add, Mul,
Equal, Where, Cast, ...) compute in numpy when every input is static.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from enginekit.backends.xla.ops.common import OpError, cast, is_static, np_dtype, xp

# -- unary math -----------------------------------------------------------------------------


def Abs(X: Any) -> Any:
    return xp(X).abs(X)


def Neg(X: Any) -> Any:
    return -X


def Sqrt(X: Any) -> Any:
    return xp(X).sqrt(X)


def Exp(input: Any) -> Any:
    return xp(input).exp(input)


def Log(input: Any) -> Any:
    return xp(input).log(input)


def Reciprocal(X: Any) -> Any:
    return xp(X).reciprocal(X)


def Floor(X: Any) -> Any:
    return xp(X).floor(X)


def Ceil(X: Any) -> Any:
    return xp(X).ceil(X)


def Round(X: Any) -> Any:
    # numpy and jax both round half to even, as ONNX asks.
    return xp(X).round(X)


def Sign(input: Any) -> Any:
    return xp(input).sign(input)


def Sin(input: Any) -> Any:
    return xp(input).sin(input)


def Cos(input: Any) -> Any:
    return xp(input).cos(input)


def Tan(input: Any) -> Any:
    return xp(input).tan(input)


def Asin(input: Any) -> Any:
    return xp(input).arcsin(input)


def Acos(input: Any) -> Any:
    return xp(input).arccos(input)


def Atan(input: Any) -> Any:
    return xp(input).arctan(input)


def Sinh(input: Any) -> Any:
    return xp(input).sinh(input)


def Cosh(input: Any) -> Any:
    return xp(input).cosh(input)


def Asinh(input: Any) -> Any:
    return xp(input).arcsinh(input)


def Acosh(input: Any) -> Any:
    return xp(input).arccosh(input)


def Atanh(input: Any) -> Any:
    return xp(input).arctanh(input)


def Erf(input: Any) -> Any:
    return jax.lax.erf(input)


def IsNaN(X: Any) -> Any:
    return xp(X).isnan(X)


def IsInf(X: Any, detect_negative: int = 1, detect_positive: int = 1) -> Any:
    m = xp(X)
    negative = m.logical_and(m.isinf(X), X < 0) if detect_negative else m.zeros(X.shape, bool)
    positive = m.logical_and(m.isinf(X), X > 0) if detect_positive else m.zeros(X.shape, bool)
    return m.logical_or(negative, positive)


# -- activations ----------------------------------------------------------------------------


def Relu(X: Any) -> Any:
    return xp(X).maximum(X, 0)


def LeakyRelu(X: Any, alpha: float = 0.01) -> Any:
    return xp(X).where(X >= 0, X, X * alpha)


def PRelu(X: Any, slope: Any) -> Any:
    return xp(X, slope).where(X < 0, X * slope, X).astype(X.dtype)


def PRelu_6(X: Any, slope: Any) -> Any:
    # Before opset 7 a 1-D slope was per channel (axis 1), not numpy-broadcast.
    if slope.ndim == 1 and X.ndim > 2 and slope.shape[0] == X.shape[1] and slope.shape[0] != 1:
        slope = xp(slope).reshape(slope, (-1,) + (1,) * (X.ndim - 2))
    return PRelu(X, slope)


def ThresholdedRelu(X: Any, alpha: float = 1.0) -> Any:
    return jnp.where(X > alpha, X, 0).astype(X.dtype)


def Elu(X: Any, alpha: float = 1.0) -> Any:
    return jnp.where(X > 0, X, alpha * jnp.expm1(X)).astype(X.dtype)


def Selu(
    X: Any, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875
) -> Any:
    return (gamma * jnp.where(X > 0, X, alpha * jnp.expm1(X))).astype(X.dtype)


def Celu(X: Any, alpha: float = 1.0) -> Any:
    return (jnp.maximum(X, 0) + jnp.minimum(0, alpha * jnp.expm1(X / alpha))).astype(X.dtype)


def Sigmoid(X: Any) -> Any:
    return jax.nn.sigmoid(X)


def HardSigmoid(X: Any, alpha: float = 0.2, beta: float = 0.5) -> Any:
    return jnp.clip(X * alpha + beta, 0, 1).astype(X.dtype)


def HardSwish(X: Any) -> Any:
    return (X * jnp.clip(X * (1 / 6) + 0.5, 0, 1)).astype(X.dtype)


def Tanh(input: Any) -> Any:
    return xp(input).tanh(input)


def Softplus(X: Any) -> Any:
    return jax.nn.softplus(X)


def Softsign(input: Any) -> Any:
    return input / (1 + jnp.abs(input))


def Mish(X: Any) -> Any:
    return X * jnp.tanh(jax.nn.softplus(X))


def Gelu(X: Any, approximate: str = "none") -> Any:
    if approximate not in ("none", "tanh"):
        raise OpError(f"Gelu approximate={approximate!r}: expected 'none' or 'tanh'")
    return jax.nn.gelu(X, approximate=approximate == "tanh")


# -- binary and variadic math ---------------------------------------------------------------


def Add(A: Any, B: Any) -> Any:
    return A + B


def Sub(A: Any, B: Any) -> Any:
    return A - B


def Mul(A: Any, B: Any) -> Any:
    return A * B


def Div(A: Any, B: Any) -> Any:
    if A.dtype == np.dtype(object) or getattr(B, "dtype", None) == np.dtype(object):
        return A // B  # symbolic dims are positive: floor and truncation agree
    if not np.issubdtype(A.dtype, np.integer):
        return A / B
    if is_static(A) and is_static(B):
        quotient = np.floor_divide(A, B)
        wrong_sign = (np.remainder(A, B) != 0) & ((A < 0) ^ (B < 0))
        return (quotient + wrong_sign.astype(quotient.dtype)).astype(A.dtype)
    a, b = jnp.broadcast_arrays(A, B)
    # lax.div truncates toward zero, as ONNX integer Div does.
    return jax.lax.div(a, b.astype(a.dtype))


def Pow(X: Any, Y: Any) -> Any:
    m = xp(X, Y)
    if is_static(X) and is_static(Y):
        return np.asarray(np.power(X, Y)).astype(X.dtype)
    if np.issubdtype(X.dtype, np.floating) and np.issubdtype(np.dtype(Y.dtype), np.integer):
        # An integer exponent keeps the float base's precision (x ** 2 stays a multiply).
        return m.power(X, Y).astype(X.dtype)
    return m.power(X, Y.astype(jnp.result_type(X.dtype, Y.dtype))).astype(X.dtype)


def Mod(A: Any, B: Any, fmod: int = 0) -> Any:
    m = xp(A, B)
    if fmod:
        return m.fmod(A, B)
    return m.mod(A, B)


def Max(*data_0: Any) -> Any:
    return functools.reduce(xp(*data_0).maximum, data_0)


def Min(*data_0: Any) -> Any:
    return functools.reduce(xp(*data_0).minimum, data_0)


def Sum(*data_0: Any) -> Any:
    return functools.reduce(lambda a, b: a + b, data_0)


def Mean(*data_0: Any) -> Any:
    total = functools.reduce(lambda a, b: a + b, data_0)
    return (total / len(data_0)).astype(data_0[0].dtype)


def Clip(input: Any, min: Any = None, max: Any = None) -> Any:
    m = xp(input, min, max)
    out = input
    if min is not None:
        out = m.maximum(out, m.asarray(min, dtype=input.dtype))
    if max is not None:
        out = m.minimum(out, m.asarray(max, dtype=input.dtype))
    return out


# -- comparisons and logic ------------------------------------------------------------------


def _compare(name: str, A: Any, B: Any) -> Any:
    m = xp(A, B)
    out = getattr(m, name)(A, B)
    return np.asarray(out, dtype=bool) if m is np else out


def Equal(A: Any, B: Any) -> Any:
    return _compare("equal", A, B)


def Less(A: Any, B: Any) -> Any:
    return _compare("less", A, B)


def LessOrEqual(A: Any, B: Any) -> Any:
    return _compare("less_equal", A, B)


def Greater(A: Any, B: Any) -> Any:
    return _compare("greater", A, B)


def GreaterOrEqual(A: Any, B: Any) -> Any:
    return _compare("greater_equal", A, B)


def Not(X: Any) -> Any:
    return xp(X).logical_not(X)


def And(A: Any, B: Any) -> Any:
    return xp(A, B).logical_and(A, B)


def Or(A: Any, B: Any) -> Any:
    return xp(A, B).logical_or(A, B)


def Xor(A: Any, B: Any) -> Any:
    return xp(A, B).logical_xor(A, B)


def Where(condition: Any, X: Any, Y: Any) -> Any:
    m = xp(condition, X, Y)
    out = m.where(condition, X, Y)
    if m is np and out.dtype != object:
        return out.astype(np.result_type(X.dtype, Y.dtype))
    return out


# -- types ----------------------------------------------------------------------------------


def Cast(input: Any, to: int = 1, saturate: int = 1, round_mode: str = "up") -> Any:
    # saturate and round_mode only concern float8/float4 targets, which np_dtype refuses.
    return cast(input, np_dtype(to))


def CastLike(input: Any, target_type: Any, saturate: int = 1, round_mode: str = "up") -> Any:
    if target_type.dtype == object:
        return cast(input, np.dtype(np.int64))
    return cast(input, np_dtype(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(target_type.dtype))))


def Identity(input: Any) -> Any:
    return input
