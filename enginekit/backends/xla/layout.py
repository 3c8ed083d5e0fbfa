"""Tensor layouts the lowering tracks, and which ops keep activations channels-last.

A layout tag says how a held array relates to the ONNX tensor it stands for:

- ``""``: as ONNX has it (NCHW for activations, OIHW for kernels);
- ``"nhwc"``: the channel dim (1) moved last: NCHW -> NHWC, NCW -> NWC, NCDHW -> NDHWC;
- ``"hwio"``: a Conv kernel with its spatial dims first: OIHW -> HWIO;
- ``"convt_oihw:G"`` / ``"convt_hwio:G"``: a ConvTranspose kernel rewritten as the forward
  kernel that ``lax.conv_general_dilated`` runs (flipped, groups regrouped), one-way.

In NHWC mode, convolutions and pools ("anchors") pull their input into ``nhwc``; channel-aware
ops ("followers": BatchNormalization, LRN, global pools, ...) and elementwise ops keep whatever
layout their input has; ops with an axis (Concat, Split, Softmax, Reduce*, Pad, per-axis Q/DQ)
have the axis remapped. Everything else sees ONNX layout, so the lowering converts back only
where the model leaves the conv/pool/elementwise world — once at each edge.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from enginekit.backends.xla.ops.common import OpError, is_static, xp

ONNX = ""
NHWC = "nhwc"
HWIO = "hwio"

#: Convolutions and pools: their activation input is made channels-last in NHWC mode.
ANCHORS = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"})

#: Channel-aware ops that run in either layout (``channels_last`` follows their input).
FOLLOWERS = frozenset(
    {"BatchNormalization", "InstanceNormalization", "LRN", "GlobalAveragePool", "GlobalMaxPool"}
)

#: Ops whose every input broadcasts against the others elementwise.
ELEMENTWISE = frozenset(
    {
        "Abs", "Neg", "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Round", "Sign",
        "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
        "Erf", "IsNaN", "IsInf", "Relu", "LeakyRelu", "PRelu", "ThresholdedRelu", "Elu", "Selu",
        "Celu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Softsign", "Mish",
        "Gelu", "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Clip",
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
        "Where", "Cast", "Identity", "Dropout",
    }
)  # fmt: skip

#: Ops with one ``axis`` attribute over their first input(s), remappable to channels-last.
AXIS_OPS = frozenset({"Concat", "Split", "Softmax", "LogSoftmax", "Hardmax"})

REDUCTIONS = frozenset(
    {
        "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
        "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
    }
)  # fmt: skip

QUANT = frozenset({"QuantizeLinear", "DequantizeLinear"})


def nhwc_perm(rank: int) -> tuple[int, ...]:
    """The transpose taking an ONNX (channels-first) tensor to channels-last."""
    return (0, *range(2, rank), 1)


def nhwc_axis(a: int, rank: int) -> int:
    """Where ONNX axis ``a`` of a rank-``rank`` tensor sits once channels-last."""
    a = a + rank if a < 0 else a
    if a == 0:
        return 0
    if a == 1:
        return rank - 1
    return a - 1


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(perm))


def _hwio_perm(rank: int) -> tuple[int, ...]:
    return (*range(2, rank), 1, 0)


def _conv_transpose_kernel(w: Any, tag: str) -> Any:
    """ONNX ConvTranspose weights (C_in, C_out/G, k...) as a forward-conv kernel."""
    kind, _, groups_text = tag.partition(":")
    groups = int(groups_text)
    m = xp(w)
    c_in, c_out_g = w.shape[0], w.shape[1]
    spatial = tuple(w.shape[2:])
    n = len(spatial)
    grouped = m.reshape(w, (groups, c_in // groups, c_out_g, *spatial))
    flipped = m.flip(grouped, axis=tuple(range(3, 3 + n)))
    if kind == "convt_oihw":
        moved = m.transpose(flipped, (0, 2, 1, *range(3, 3 + n)))
        return m.reshape(moved, (groups * c_out_g, c_in // groups, *spatial))
    moved = m.transpose(flipped, (*range(3, 3 + n), 1, 0, 2))
    return m.reshape(moved, (*spatial, c_in // groups, groups * c_out_g))


def to_layout(x: Any, tag: str) -> Any:
    """An ONNX-layout array in layout ``tag`` (numpy stays numpy)."""
    if tag == ONNX or x.ndim < 3:
        return x
    if tag == NHWC:
        return xp(x).transpose(x, nhwc_perm(x.ndim))
    if tag == HWIO:
        return xp(x).transpose(x, _hwio_perm(x.ndim))
    if tag.startswith("convt_"):
        return _conv_transpose_kernel(x, tag)
    raise ValueError(f"unknown layout {tag!r}")


def from_layout(x: Any, tag: str) -> Any:
    """An array held in layout ``tag`` back in ONNX layout."""
    if tag == ONNX or x.ndim < 3:
        return x
    if tag == NHWC:
        return xp(x).transpose(x, _inverse(nhwc_perm(x.ndim)))
    if tag == HWIO:
        return xp(x).transpose(x, _inverse(_hwio_perm(x.ndim)))
    raise OpError(f"a {tag} kernel cannot be read back as an ONNX tensor")


def weight_layout(op_type: str, index: int, attrs: dict[str, Any], channels_last: bool) -> str:
    """The layout an op wants for its kernel input ``index`` (ONNX for every other input)."""
    if index != 1:
        return ONNX
    if op_type == "Conv":
        return HWIO if channels_last else ONNX
    if op_type == "ConvTranspose":
        groups = int(attrs.get("group", 1))
        return f"convt_hwio:{groups}" if channels_last else f"convt_oihw:{groups}"
    return ONNX


def remap_axis_attrs(
    op_type: str, opset: int, attrs: dict[str, Any], rank: int
) -> dict[str, Any] | None:
    """``attrs`` with the op's axis moved to channels-last, or None if the op cannot follow."""
    if op_type in ("Softmax", "LogSoftmax", "Hardmax") and opset < 13:
        return None  # older opsets flatten at the axis: a layout-sensitive reshape
    default = -1 if op_type in ("Softmax", "LogSoftmax", "Hardmax") else 0
    a = int(attrs.get("axis", default))
    return {**attrs, "axis": nhwc_axis(a, rank)}


def remap_reduce(
    args: list[Any], attrs: dict[str, Any], rank: int
) -> tuple[list[Any], dict[str, Any]] | None:
    """A Reduce* call with its axes (attribute or input) moved to channels-last."""
    if not attrs.get("keepdims", 1):
        return None
    if len(args) > 1 and args[1] is not None:
        if not is_static(args[1]):
            return None
        axes = np.asarray([nhwc_axis(int(a), rank) for a in np.ravel(args[1])], dtype=np.int64)
        return [args[0], axes, *args[2:]], attrs
    if "axes" in attrs:
        return args, {**attrs, "axes": [nhwc_axis(int(a), rank) for a in attrs["axes"]]}
    return args, attrs


def remap_pad(
    args: list[Any], attrs: dict[str, Any], rank: int
) -> tuple[list[Any], dict[str, Any]] | None:
    """A Pad call with its pads (attribute or input) reordered to channels-last."""
    if len(args) > 3 and args[3] is not None:
        return None  # explicit axes input: rare, keep ONNX layout
    perm = nhwc_perm(rank)
    if len(args) > 1 and args[1] is not None:
        if not is_static(args[1]):
            return None
        flat = np.ravel(args[1])
        pads = np.asarray([flat[p] for p in perm] + [flat[rank + p] for p in perm], dtype=np.int64)
        return [args[0], pads, *args[2:]], attrs
    if "pads" in attrs:
        given = list(attrs["pads"])
        return args, {**attrs, "pads": [given[p] for p in perm] + [given[rank + p] for p in perm]}
    return None


def remap_quant(
    args: list[Any], attrs: dict[str, Any], rank: int
) -> tuple[list[Any], dict[str, Any]] | None:
    """Q/DQ: per-tensor follows any layout; per-axis has its axis remapped; blocked cannot."""
    scale = args[1] if len(args) > 1 else None
    if scale is None or attrs.get("block_size", 0):
        return None
    if scale.ndim == 0 or int(np.prod(scale.shape)) == 1:
        return args, attrs
    return args, {**attrs, "axis": nhwc_axis(int(attrs.get("axis", 1)), rank)}
