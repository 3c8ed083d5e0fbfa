"""Resize (opsets 10-19) and Upsample: separable interpolation, one axis at a time.

For each resized axis the source positions and weights are computed in numpy when the model is
built (sizes and scales are static), following the ONNX reference: every output position reads
``n`` neighbours (1 for nearest, 2 linear, 4 cubic; more when antialiasing a downscale), edge
clamped, and sums them weighted. The program holds one gather (nearest) or one gather and a
weighted sum per axis; axes whose size does not change (the batch, the channels) are untouched,
so a symbolic batch stays symbolic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from enginekit.backends.xla.ops.common import OpError, ints, static, to_jax

Coeffs = Callable[[float, float], np.ndarray]


def _nearest(rounding: str) -> Coeffs:
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        if rounding == "round_prefer_floor":
            return np.array([ratio <= 0.5, ratio > 0.5], dtype=np.float64)
        if rounding == "round_prefer_ceil":
            return np.array([ratio < 0.5, ratio >= 0.5], dtype=np.float64)
        if rounding == "floor":
            return np.array([1.0, 0.0])
        if rounding == "ceil":
            return np.array([0.0, 1.0])
        raise OpError(
            f"nearest_mode {rounding!r}: expected round_prefer_floor, round_prefer_ceil, "
            "floor or ceil"
        )

    return coeffs


def _linear(antialias: bool) -> Coeffs:
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1 - ratio, ratio])
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        args = (np.arange(start, 2 - start) - ratio) * s
        taps = np.clip(1 - np.abs(args), 0, 1)
        return np.asarray(taps / taps.sum())

    return coeffs


def _cubic(a: float, antialias: bool) -> Coeffs:
    def kernel(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        if x < 2:
            return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        return 0.0

    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array(
                [kernel(ratio + 1), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)]
            )
        s = min(scale, 1.0)
        start = int(np.floor(-2 / s) + 1)
        taps = np.array([kernel(s * (i - ratio)) for i in range(start, 2 - start)])
        return np.asarray(taps / taps.sum())

    return coeffs


def _source(
    mode: str, out: int, size: int, scale: float, roi: tuple[float, float] | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Source coordinate of each output position, and which ones fall outside (crop mode)."""
    y = np.arange(out, dtype=np.float64)
    width = scale * size
    if mode == "align_corners":
        return (np.zeros(out) if width == 1 else y * (size - 1) / (width - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "pytorch_half_pixel":
        return (np.full(out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / width)
        return offset + (y + 0.5) / scale - 0.5, None
    if mode == "tf_crop_and_resize":
        lo, hi = roi if roi is not None else (0.0, 1.0)
        if width == 1:
            x = np.full(out, (hi - lo) * (size - 1) / 2)
        else:
            x = y * (hi - lo) * (size - 1) / (width - 1)
        x = x + lo * (size - 1)
        return x, (x < 0) | (x > size - 1)
    raise OpError(
        f"coordinate_transformation_mode {mode!r}: expected half_pixel, half_pixel_symmetric, "
        "pytorch_half_pixel, align_corners, asymmetric or tf_crop_and_resize"
    )


def _taps(
    x: np.ndarray, size: int, scale: float, coeffs: Coeffs, exclude_outside: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per output position, the ``n`` (clamped) source indices and their weights."""
    floor = np.floor(x)
    ratios = np.where(x == floor, 1.0, x - floor)
    weights = np.stack([np.asarray(coeffs(float(r), scale), np.float64) for r in ratios])
    n = weights.shape[1]
    pad = math.ceil(n / 2)
    padded = x + pad
    base = np.floor(padded)
    frac = padded - base
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        offset = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    index = (base + offset).astype(np.int64)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        weights = np.where((index < 0) | (index >= size), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, size - 1), weights


def _resize_axis(
    data: Any, axis: int, out: int, scale: float, how: dict[str, Any], roi: Any, fill: float
) -> Any:
    size = data.shape[axis]
    x, outside = _source(how["transform"], out, size, scale, roi)
    index, weights = _taps(x, size, scale, how["coeffs"], how["exclude_outside"])
    if how["nearest"]:
        picked = index[np.arange(out), np.argmax(weights, axis=1)]
        result = jnp.take(data, picked, axis=axis)
    else:
        gathered = jnp.take(data, index.reshape(-1), axis=axis)
        gathered = gathered.reshape(data.shape[:axis] + index.shape + data.shape[axis + 1 :])
        shape = (1,) * axis + weights.shape + (1,) * (data.ndim - axis - 1)
        result = jnp.sum(gathered * weights.reshape(shape).astype(data.dtype), axis=axis + 1)
    if outside is not None and outside.any():
        mask = outside.reshape((1,) * axis + (out,) + (1,) * (data.ndim - axis - 1))
        result = jnp.where(mask, jnp.asarray(fill, data.dtype), result)
    return result


def _output_dims(
    dims: tuple[Any, ...],
    scales: list[float] | None,
    sizes: list[int] | None,
    policy: str,
    axes: list[int],
) -> tuple[list[Any], list[float]]:
    rank = len(dims)
    if sizes is not None:
        full_sizes: list[Any] = list(dims)
        for a, s in zip(axes, sizes):
            full_sizes[a] = s
        ratio = [
            full_sizes[a] / dims[a] if a in axes and isinstance(dims[a], int) else 1.0
            for a in range(rank)
        ]
        if policy == "stretch":
            return full_sizes, ratio
        if policy not in ("not_larger", "not_smaller"):
            raise OpError(
                f"keep_aspect_ratio_policy {policy!r}: expected stretch, not_larger or not_smaller"
            )
        if any(not isinstance(dims[a], int) for a in axes):
            raise OpError(
                f"keep_aspect_ratio_policy {policy!r} over a symbolic axis (input dims {dims}): "
                "name only the spatial axes in Resize's axes, or pin the symbolic dims"
            )
        pick = min if policy == "not_larger" else max
        scale = pick(ratio[a] for a in axes)
        out = [int(scale * dims[a] + 0.5) if a in axes else dims[a] for a in range(rank)]
        return out, [scale if a in axes else 1.0 for a in range(rank)]
    full = [1.0] * rank
    for a, factor in zip(axes, scales or []):
        full[a] = float(factor)
    scaled: list[Any] = [
        d if full[a] == 1.0 else math.floor(d * full[a]) for a, d in enumerate(dims)
    ]
    return scaled, full


def _same(a: Any, b: Any) -> bool:
    """Whether two dims (ints or symbolic expressions like ``batch``) are provably equal;
    comparing a symbolic dim with a different one or an int is never an error, just False."""
    try:
        return bool(a == b)
    except Exception:  # jax's InconclusiveDimensionOperation
        return False


def _interpolate(
    X: Any,
    roi: Any,
    scales: Any,
    sizes: Any,
    how: dict[str, Any],
    axes: list[int] | None,
    policy: str,
    fill: float,
) -> Any:
    rank = X.ndim
    picked = [a + rank if a < 0 else a for a in axes] if axes else list(range(rank))
    scale_list = (
        None
        if scales is None or np.size(static(scales, "Resize's scales")) == 0
        else [float(s) for s in static(scales, "Resize's scales").reshape(-1)]
    )
    size_list = (
        None
        if sizes is None or np.size(static(sizes, "Resize's sizes")) == 0
        else ints(sizes, "Resize's sizes")
    )
    if scale_list is None and size_list is None:
        raise OpError("Resize needs scales or sizes")
    out, factor = _output_dims(tuple(X.shape), scale_list, size_list, policy, picked)
    roi_flat = None
    if roi is not None and np.size(static(roi, "Resize's roi")):
        roi_flat = [float(v) for v in static(roi, "Resize's roi").reshape(-1)]
    result = to_jax(X)
    dtype = result.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        result = result.astype(jnp.float32)
    for i, a in enumerate(picked):
        span = None if roi_flat is None else (roi_flat[i], roi_flat[i + len(picked)])
        if _same(out[a], X.shape[a]) and factor[a] == 1.0 and span in (None, (0.0, 1.0)):
            continue  # the batch and channels, symbolic or not, pass through untouched
        if not isinstance(X.shape[a], int) or not isinstance(out[a], (int, np.integer)):
            raise OpError(
                f"Resize of axis {a} from size {X.shape[a]} to {out[a]}: only axes of fixed "
                "size can be resized; keep symbolic dims (batch) unchanged or pin them"
            )
        result = _resize_axis(result, a, int(out[a]), factor[a], how, span, fill)
    if result.dtype != dtype:
        info = jnp.iinfo(dtype)
        result = jnp.clip(jnp.round(result), info.min, info.max).astype(dtype)
    return result


def _how(
    mode: str,
    transform: str,
    nearest_mode: str,
    cubic_coeff_a: float,
    antialias: int,
    exclude_outside: int,
) -> dict[str, Any]:
    if mode == "nearest":
        coeffs = _nearest(nearest_mode)
    elif mode in ("linear", "bilinear", "trilinear"):
        coeffs = _linear(bool(antialias))
    elif mode in ("cubic", "bicubic"):
        coeffs = _cubic(cubic_coeff_a, bool(antialias))
    else:
        raise OpError(f"Resize mode {mode!r}: expected nearest, linear or cubic")
    return {
        "coeffs": coeffs,
        "nearest": mode == "nearest",
        "transform": transform,
        "exclude_outside": bool(exclude_outside),
    }


def Resize(
    X: Any,
    roi: Any = None,
    scales: Any = None,
    sizes: Any = None,
    antialias: int = 0,
    axes: list[int] | None = None,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    keep_aspect_ratio_policy: str = "stretch",
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> Any:
    how = _how(
        mode,
        coordinate_transformation_mode,
        nearest_mode,
        cubic_coeff_a,
        antialias,
        exclude_outside,
    )
    return _interpolate(
        X, roi, scales, sizes, how, axes, keep_aspect_ratio_policy, extrapolation_value
    )


def Resize_10(X: Any, scales: Any, mode: str = "nearest") -> Any:
    """Opset 10: Upsample's semantics (asymmetric coordinates, nearest rounds down)."""
    return Upsample(X, scales, mode=mode)


def Upsample(X: Any, scales: Any = None, mode: str = "nearest") -> Any:
    how = _how(mode, "asymmetric", "floor", -0.75, 0, 0)
    return _interpolate(X, None, scales, None, how, None, "stretch", 0.0)


def Upsample_7(X: Any, scales: list[float] | None = None, mode: str = "nearest") -> Any:
    """Opset 7-8: the scales are an attribute."""
    if scales is None:
        raise OpError("Upsample needs its scales attribute")
    return Upsample(X, np.asarray(scales, np.float32), mode=mode)
