"""ONNX Resize on TVM as one small interpolation matrix per resized axis, for the variants TVM
0.27's Relax importer gets wrong or refuses.

Resize is separable: along each axis every output element is a fixed weighted sum of input
elements, so with the input's dims static the weights are a constant ``(out, in)`` matrix per
axis. The matrices are computed here in numpy by ONNX's own reference implementation (its 1-D
interpolation applied to the identity), so every coordinate mode, nearest mode, cubic
coefficient, ``exclude_outside``, ``antialias``, ``axes`` and ``keep_aspect_ratio_policy``
means exactly what ONNX says; the program gathers (nearest) or multiplies (linear, cubic)
along each axis in turn.

TVM's importer (what the default path keeps for the common cases, where its fused
``resize2d`` is faster) ignores ``axes``, ``antialias`` and ``keep_aspect_ratio_policy``,
reads opset 10's ``scales`` as ``roi``, and derives the coordinate transform from the size
ratio rather than the given scale, which differs when ``scale * dim`` is not an integer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from enginekit.errors import BuildError

#: Interpolation modes this module computes.
_MODES = ("nearest", "linear", "cubic")

#: Coordinate modes ONNX's reference implements (opset 11's tf_half_pixel_for_nn is not).
_COORDINATES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
)


@dataclass(frozen=True)
class Axis:
    """How one axis is resized: ``weights`` (out x in, float64), ``outside`` (out, bool; the
    output positions tf_crop_and_resize fills with the extrapolation value) and ``picks``
    (out, int64; the input index of each output, where every row of ``weights`` is one-hot)."""

    axis: int
    weights: np.ndarray
    outside: np.ndarray | None
    picks: np.ndarray | None


def _text(value: Any, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def plan(
    shape: Sequence[int | None],
    attr: dict[str, Any],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
) -> list[Axis] | None:
    """The per-axis matrices of a Resize on an input of ``shape`` (None for a symbolic dim),
    or None where this module does not apply (the importer's conversion is kept): an unknown
    mode, a resized symbolic dim, or an ONNX without the reference functions used."""
    try:
        from onnx.reference.ops import op_resize as ref
    except ImportError:  # pragma: no cover - onnx always ships its reference
        return None
    if not hasattr(ref, "_interpolate_1d_along_axis") or not hasattr(ref, "_compute_x_ori"):
        return None  # an onnx without the vectorised reference: keep the importer's path
    mode = _text(attr.get("mode"), "nearest")
    coord = _text(attr.get("coordinate_transformation_mode"), "half_pixel")
    if mode not in _MODES or coord not in _COORDINATES:
        return None
    rank = len(shape)
    axes = [int(a) % rank for a in attr.get("axes", range(rank))] if rank else []
    if scales is not None and scales.size == 0:
        scales = None
    if sizes is not None and sizes.size == 0:
        sizes = None
    given = scales if scales is not None else sizes
    if given is None or (scales is not None and sizes is not None) or len(axes) != given.size:
        return None
    if roi is not None and roi.size == 0:
        roi = None
    full_roi = None
    if roi is not None:
        if roi.size != 2 * len(axes):
            return None
        full_roi = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = float(roi[i]), float(roi[len(axes) + i])
    factor, out = _scales_and_sizes(shape, axes, scales, sizes, attr)
    if factor is None or out is None:
        return None
    if all(out[a] == shape[a] for a in axes):
        # ONNX Runtime (the reference a build verifies against) copies the input when no
        # size changes, even where a tf_crop_and_resize roi would crop it.
        return []
    coeffs = _coefficients(ref, mode, attr)
    planned = []
    for a in axes:
        width, scale, size = shape[a], float(factor[a]), int(out[a])
        box = None if full_roi is None else [full_roi[a], full_roi[rank + a]]
        identity = box is None or (box[0] == 0.0 and box[1] == 1.0)
        if width is not None and size == width and np.isclose(scale, 1.0) and identity:
            continue  # the reference skips an axis that stays as it is
        if width is None or width == 0 or size == 0:
            return None
        if coord == "tf_crop_and_resize" and box is None:
            return None
        weights = ref._interpolate_1d_along_axis(
            np.eye(width),
            0,
            scale,
            size,
            coeffs,
            roi=box,
            extrapolation_value=0.0,
            coordinate_transformation_mode=coord,
            exclude_outside=bool(int(attr.get("exclude_outside", 0))),
        )
        _, outside = ref._compute_x_ori(
            coord, np.arange(size, dtype=np.float64), scale, width, scale * width, size, box
        )
        if outside is not None and not outside.any():
            outside = None
        picks = None
        if mode == "nearest" and np.all((weights == 0) | (weights == 1)):
            if np.all(weights.sum(axis=1) == 1):
                picks = weights.argmax(axis=1).astype(np.int64)
        planned.append(Axis(a, weights, outside, picks))
    return planned


def _scales_and_sizes(
    shape: Sequence[int | None],
    axes: list[int],
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    attr: dict[str, Any],
) -> tuple[list[float] | None, list[int] | None]:
    """Every axis's scale factor and output size, as ONNX's reference derives them."""
    rank = len(shape)
    if scales is not None:
        factor = [1.0] * rank
        for i, a in enumerate(axes):
            factor[a] = float(scales[i])
        out: list[int] = []
        for a in range(rank):
            dim = shape[a]
            if dim is None:
                if factor[a] != 1.0:
                    return None, None
                out.append(-1)
            else:
                # float32 scale times the dim in float64, truncated, as the reference does.
                out.append(int(np.float64(np.float32(factor[a])) * dim))
        return factor, out
    assert sizes is not None
    if any(shape[a] is None for a in axes):
        return None, None
    dims = [int(d) if d is not None else -1 for d in shape]
    out = list(dims)
    for i, a in enumerate(axes):
        out[a] = int(sizes[i])
    factor = [out[a] / dims[a] if a in axes and dims[a] else 1.0 for a in range(rank)]
    policy = _text(attr.get("keep_aspect_ratio_policy"), "stretch")
    if policy != "stretch":
        chosen = [factor[a] for a in axes]
        if policy == "not_larger":
            scale = min(chosen)
        elif policy == "not_smaller":
            scale = max(chosen)
        else:
            return None, None
        factor = [scale if a in axes else 1.0 for a in range(rank)]
        out = [int(scale * dims[a] + 0.5) if a in axes else dims[a] for a in range(rank)]
    return factor, out


def _coefficients(ref: Any, mode: str, attr: dict[str, Any]) -> Any:
    """The reference's coefficient function for ``mode`` (as its Resize op picks it)."""
    antialias = bool(int(attr.get("antialias", 0)))
    if mode == "nearest":
        rounding = _text(attr.get("nearest_mode"), "round_prefer_floor")
        return lambda ratio, scale: ref._nearest_coeffs(ratio, mode=rounding)
    if mode == "cubic":
        a = float(attr.get("cubic_coeff_a", -0.75))
        cubic = ref._cubic_coeffs_antialias if antialias else ref._cubic_coeffs
        return lambda ratio, scale: cubic(ratio, scale, A=a)
    return ref._linear_coeffs_antialias if antialias else ref._linear_coeffs


def emit(bb: Any, x: Any, planned: list[Axis], extrapolation: float) -> Any:
    """The resized ``x``: a gather (nearest) or a matmul with the transposed weights (linear,
    cubic; float inputs only, computed in float32 at least) along each planned axis."""
    from tvm import relax

    dtype = str(x.ty.dtype)
    rank = x.ty.ndim
    work = dtype if dtype in ("float32", "float64") else "float32"
    y = x
    for step in planned:
        if step.picks is not None:
            y = bb.emit(relax.op.take(y, relax.const(step.picks, "int64"), axis=step.axis))
            continue
        if str(y.ty.dtype) != work:
            y = bb.emit(relax.op.astype(y, work))
        order = [a for a in range(rank) if a != step.axis] + [step.axis]
        back = [order.index(a) for a in range(rank)]
        moved = bb.emit(relax.op.permute_dims(y, order))
        mixed = bb.emit(relax.op.matmul(moved, relax.const(step.weights.T.astype(work), work)))
        y = bb.emit(relax.op.permute_dims(mixed, back))
    outside = [s for s in planned if s.outside is not None]
    if outside:
        mask = np.zeros([1] * rank, bool)
        for s in outside:
            assert s.outside is not None
            view = [1] * rank
            view[s.axis] = s.outside.size
            mask = mask | s.outside.reshape(view)
        fill = relax.const(np.array(extrapolation, str(y.ty.dtype)), str(y.ty.dtype))
        y = bb.emit(relax.op.where(relax.const(mask, "bool"), fill, y))
    if str(y.ty.dtype) != dtype:
        if np.issubdtype(np.dtype(dtype), np.integer):
            info = np.iinfo(dtype)
            y = bb.emit(relax.op.round(y))
            y = bb.emit(relax.op.clip(y, float(info.min), float(info.max)))
        y = bb.emit(relax.op.astype(y, dtype))
    return y


def needs_plan(
    attr: dict[str, Any],
    planned: list[Axis],
    shape: Sequence[int | None],
    scales: np.ndarray | None,
    axes: Sequence[int],
) -> bool:
    """Whether the importer's conversion is wrong for this Resize (see the module docstring),
    so that the planned matrices are used; the common cases keep TVM's ``resize2d``."""
    if "axes" in attr or int(attr.get("antialias", 0)):
        return True
    if _text(attr.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
        return True
    mode = _text(attr.get("mode"), "nearest")
    if mode == "cubic" or int(attr.get("exclude_outside", 0)):
        return True
    coord = _text(attr.get("coordinate_transformation_mode"), "half_pixel")
    if coord in ("tf_crop_and_resize", "half_pixel_symmetric"):
        return True
    # scale * dim not a whole number: the importer's ratio out/in differs from the given
    # scale, which ONNX's coordinate transform uses.
    if scales is not None:
        for step in planned:
            dim = shape[step.axis]
            scale = float(np.ravel(scales)[list(axes).index(step.axis)])
            if dim is not None and not float(np.float32(scale) * dim).is_integer():
                return True
    return False


def converter(base: Any) -> Any:
    """A Resize converter over ``base`` (the importer's, or enginekit's fix of it) that emits
    :func:`plan`'s matrices where :func:`needs_plan` says the importer is wrong."""
    import tvm
    from tvm.relax.frontend.onnx import onnx_frontend

    def convert(cls: Any, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
        x = inputs[0]
        shape = x.ty.shape
        if shape is None or x.ty.ndim < 1:
            return base._impl_v18(bb, inputs, attr, params)
        dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in shape]

        def constant(i: int) -> np.ndarray | None:
            if len(inputs) <= i or inputs[i] is None:
                return None
            value = onnx_frontend.get_constant(inputs[i], params)
            if not isinstance(value, tvm.ir.GenericConst):
                return None
            return np.asarray(value.value.numpy())

        roi, scales, sizes = constant(1), constant(2), constant(3)
        known = all(
            len(inputs) <= i or inputs[i] is None or v is not None
            for i, v in ((1, roi), (2, scales), (3, sizes))
        )
        for what, value in (("scales", scales), ("sizes", sizes)):
            if value is not None and value.size and not (value > 0).all():
                name = attr["tvm_custom"]["name"] or "<unnamed>"
                raise BuildError(
                    f"Resize at node {name!r} got {what} {value.tolist()}: expected every "
                    "entry > 0. Where they come from a value input, the build's example "
                    "values were generated: pass verify_data= (CLI: --verify-data) with "
                    "inputs the model accepts."
                )
        planned = plan(dims, dict(attr), roi, scales, sizes) if known else None
        rank = len(dims)
        axes = [int(a) % rank for a in attr.get("axes", range(rank))]
        if planned is None or not needs_plan(attr, planned, dims, scales, axes):
            return base._impl_v18(bb, inputs, attr, params)
        return emit(bb, x, planned, float(attr.get("extrapolation_value", 0.0)))

    impl = classmethod(convert)
    return type(
        "Resize", (base,), {"__doc__": converter.__doc__, "_impl_v11": impl, "_impl_v18": impl}
    )
