"""QuantizeLinear / DequantizeLinear: per-tensor, per-axis and blocked, 8/16/32-bit integers.

Both compute in numpy when their inputs are static, so a DequantizeLinear on quantized weights
folds into float weights once at build time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from enginekit.backends.xla.ops.common import OpError, is_static, np_dtype, xp

_RANGES = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
    np.dtype(np.int32): (-(2**31), 2**31 - 1),
}


def _param(value: Any, x: Any, axis: int, block_size: int) -> Any:
    """A scale or zero point shaped to broadcast against ``x``."""
    m = xp(value)
    if value.ndim == 0 or (value.size == 1 and not block_size):
        return m.reshape(value, ())
    a = axis + x.ndim if axis < 0 else axis
    if block_size:
        repeated = m.repeat(value, block_size, axis=a)
        index = [slice(None)] * x.ndim
        index[a] = slice(0, x.shape[a])
        return repeated[tuple(index)]
    if value.ndim != 1:
        raise OpError(f"a per-axis scale must be 1-D, got shape {value.shape}")
    return m.reshape(value, [1] * a + [-1] + [1] * (x.ndim - a - 1))


def QuantizeLinear(
    x: Any,
    y_scale: Any,
    y_zero_point: Any = None,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
    saturate: int = 1,
) -> Any:
    if y_zero_point is not None:
        dtype = np.dtype(y_zero_point.dtype)
    elif output_dtype:
        dtype = np_dtype(output_dtype)
    else:
        dtype = np.dtype(np.uint8)
    if dtype not in _RANGES:
        raise OpError(f"QuantizeLinear to {dtype} is not supported (8/16-bit integers only)")
    m = xp(x, y_scale, y_zero_point)
    scale = _param(y_scale, x, axis, block_size)
    if precision:
        compute = np_dtype(precision)
        scaled = x.astype(compute) / scale.astype(compute)
    else:
        scaled = x / scale
    q = m.round(scaled).astype(np.int32)
    if y_zero_point is not None:
        q = q + _param(y_zero_point, x, axis, block_size).astype(np.int32)
    lo, hi = _RANGES[dtype]
    return m.clip(q, lo, hi).astype(dtype)


def DequantizeLinear(
    x: Any,
    x_scale: Any,
    x_zero_point: Any = None,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> Any:
    if np.dtype(x.dtype) not in _RANGES:
        raise OpError(f"DequantizeLinear from {x.dtype} is not supported (8/16/32-bit integers)")
    values = x.astype(np.float32)
    if x_zero_point is not None:
        values = values - _param(x_zero_point, x, axis, block_size).astype(np.float32)
    y = values * _param(x_scale, x, axis, block_size)
    out = np_dtype(output_dtype) if output_dtype else np.dtype(x_scale.dtype)
    result = y.astype(out)
    return np.asarray(result) if is_static(x) and is_static(x_scale) else result
