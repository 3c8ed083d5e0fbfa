"""Helpers the op functions share: static (numpy) versus traced (jax) values, axes, dtypes.

A value flowing through the lowering is either *static* — a numpy array known at trace time,
possibly of dtype object when it holds symbolic dims such as ``batch`` — or *traced* — a jax
array. Ops pick numpy when every input is static, so shape arithmetic (Shape -> Gather -> Concat
-> Reshape) never becomes part of the compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import onnx

from enginekit.errors import BuildError

Pads = list[tuple[int, int]]

#: Ends of Slice ranges at or past this are "to the end" (exporters write INT64_MAX or INT32_MAX).
BIG = 2**31 - 1


class OpError(BuildError):
    """An op cannot lower the node it was given (an attribute value or input it does not handle)."""


def is_static(value: Any) -> bool:
    """Whether ``value`` is known at trace time (a numpy array or scalar)."""
    return isinstance(value, (np.ndarray, np.generic))


def xp(*values: Any) -> Any:
    """numpy when every non-None value is static, else jax.numpy."""
    if all(v is None or is_static(v) for v in values):
        return np
    return jnp


def static(value: Any, what: str) -> np.ndarray:
    """``value`` as numpy; raises when it is only known at run time."""
    if isinstance(value, (list, tuple)):  # an attribute from an older opset
        return np.asarray(value)
    if value is None or not is_static(value):
        raise OpError(
            f"{what} must be known when the model is built, but it is computed from the inputs "
            "at run time; XLA needs it fixed to compile"
        )
    return np.asarray(value)


def ints(value: Any, what: str) -> list[int]:
    """A static 1-D list of Python ints (symbolic dims stay symbolic)."""
    return [
        d if not isinstance(d, (int, np.integer)) else int(d) for d in np.ravel(static(value, what))
    ]


def optional_ints(value: Any, what: str) -> list[int] | None:
    """Like :func:`ints`, but None (an omitted input or attribute) stays None."""
    if value is None:
        return None
    return ints(value, what)


def scalar(value: Any, what: str) -> Any:
    """A static scalar as a Python number."""
    return static(value, what).reshape(-1)[0].item()


def axis(a: int, rank: int) -> int:
    """A possibly negative axis as a non-negative one."""
    if not -rank <= a < max(rank, 1):
        raise OpError(f"axis {a} is out of range for a rank-{rank} tensor")
    return a + rank if a < 0 else a


def axes(values: Sequence[int] | None, rank: int) -> list[int]:
    """Normalized axes; None means every axis."""
    if values is None:
        return list(range(rank))
    return [axis(int(a), rank) for a in values]


def shape_array(dims: Sequence[Any]) -> np.ndarray:
    """A static int64 shape tensor; dtype object when a dim is symbolic."""
    if all(isinstance(d, (int, np.integer)) for d in dims):
        return np.asarray([int(d) for d in dims], dtype=np.int64)
    return np.asarray(list(dims), dtype=object)


def to_jax(value: Any) -> Any:
    """A traced-ready array: symbolic-dim (object) arrays become int64 jax arrays."""
    if isinstance(value, np.ndarray) and value.dtype == object:
        flat = [jnp.asarray(d, dtype=jnp.int64) for d in value.reshape(-1)]
        return jnp.stack(flat).reshape(value.shape) if flat else jnp.zeros(value.shape, jnp.int64)
    return value


def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX TensorProto data type."""
    if onnx_type in UNSUPPORTED_TYPES:
        name = onnx.TensorProto.DataType.Name(onnx_type)
        raise OpError(f"tensor type {name} is not supported by the XLA backend")
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


UNSUPPORTED_TYPES = {
    onnx.TensorProto.STRING,
    onnx.TensorProto.UNDEFINED,
    *(
        getattr(onnx.TensorProto, name)
        for name in (
            "FLOAT8E4M3FN",
            "FLOAT8E4M3FNUZ",
            "FLOAT8E5M2",
            "FLOAT8E5M2FNUZ",
            "FLOAT8E8M0",
            "UINT4",
            "INT4",
            "FLOAT4E2M1",
            "UINT2",
            "INT2",
        )
        if hasattr(onnx.TensorProto, name)
    ),
}


def cast(value: Any, dtype: np.dtype) -> Any:
    """``value`` as ``dtype``, staying numpy when static (symbolic dims stay symbolic)."""
    if is_static(value):
        value = np.asarray(value)
        if value.dtype == object:
            if dtype.kind in "iu":
                return value
            return to_jax(value).astype(dtype)
        return value.astype(dtype)
    return value.astype(dtype)


def size_of(dims: Sequence[Any]) -> Any:
    """Product of dims (an int, or a symbolic expression)."""
    total: Any = 1
    for d in dims:
        total = total * d
    return total


def is_small(dims: Sequence[Any], limit: int = 4096) -> bool:
    """Whether a tensor of ``dims`` is small enough to compute in numpy at trace time."""
    return all(isinstance(d, (int, np.integer)) for d in dims) and int(np.prod(dims)) <= limit


def float_dtype(value: Any) -> bool:
    """Whether ``value`` holds floating-point numbers."""
    return jnp.issubdtype(value.dtype, jnp.floating)


def channel_axis(rank: int, channels_last: bool) -> int:
    """Where the channel dim of a rank-``rank`` activation sits."""
    return rank - 1 if channels_last else 1


def per_channel(v: Any, rank: int, channels_last: bool) -> Any:
    """A per-channel 1-D vector shaped to broadcast against an activation."""
    if channels_last:
        return v
    return xp(v).reshape(v, (-1,) + (1,) * (rank - 2))


def spatial_axes(rank: int, channels_last: bool) -> tuple[int, ...]:
    """Axes of the spatial dims of a rank-``rank`` activation."""
    return tuple(range(1, rank - 1)) if channels_last else tuple(range(2, rank))


def spatial_dims(x: Any, channels_last: bool) -> tuple[Any, ...]:
    """The spatial dims of an activation held NCHW (or NHWC when ``channels_last``)."""
    return tuple(x.shape[1:-1]) if channels_last else tuple(x.shape[2:])


def _same_pads(auto_pad: str, size: int, k: int, s: int, d: int) -> tuple[int, int]:
    if not isinstance(size, int):
        raise OpError(f"auto_pad={auto_pad} needs static spatial dims, got {size}")
    out = -(-size // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
    small, large = total // 2, total - total // 2
    return (small, large) if auto_pad == "SAME_UPPER" else (large, small)


def explicit_pads(
    auto_pad: str,
    pads: Sequence[int] | None,
    spatial: Sequence[Any],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> Pads:
    """(begin, end) padding per spatial dim from ONNX's auto_pad / pads attributes."""
    n = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return [
            _same_pads(auto_pad, spatial[i], kernel[i], strides[i], dilations[i]) for i in range(n)
        ]
    if auto_pad == "VALID":
        return [(0, 0)] * n
    if auto_pad != "NOTSET":
        raise OpError(f"auto_pad {auto_pad!r}: expected NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    flat = list(pads) if pads else [0] * (2 * n)
    return [(flat[i], flat[i + n]) for i in range(n)]
