"""enginekit's ``MaxPool`` converter for its second output, ``Indices``: TVM 0.27's importer
converts the pooled values only ("Missing outputs during conversion. Expected 2 but Got 1").

The pool is a running maximum over the window's offsets: one strided slice of the padded
input per offset, each compared with the best so far; the index tensor (the flat position of
every input element, row- or column-major within a channel as ``storage_order`` says) is
sliced alike and follows the comparison. A strictly greater value replaces the best, so
ties keep the first offset in row-major order, as ONNX Runtime does. One-output pools keep
TVM's conversion.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from enginekit.errors import BuildError


def converters() -> dict[str, Any]:
    """The ``MaxPool`` converter."""
    from tvm.relax.frontend.onnx import onnx_frontend

    class MaxPool(onnx_frontend.MaxPool):
        """MaxPool with its ``Indices`` output (see the module's docstring)."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            if attr["tvm_custom"]["num_outputs"] < 2:
                return super()._impl_v1(bb, inputs, attr, params)
            return max_pool_with_indices(bb, inputs[0], attr)

    return {"MaxPool": MaxPool}


def window_geometry(
    size: int, kernel: int, stride: int, dilation: int, pads: tuple[int, int], ceil: bool
) -> tuple[int, int, int]:
    """(output length, padding before, padding after) of one spatial axis, the padding after
    grown to what the last window reads (``ceil_mode``) or cut to it."""
    span = dilation * (kernel - 1) + 1
    room = size + pads[0] + pads[1] - span
    out = (math.ceil(room / stride) if ceil else room // stride) + 1
    if ceil and (out - 1) * stride >= size + pads[0]:
        out -= 1  # a last window that starts in the padding after is dropped
    need = (out - 1) * stride + span
    return out, pads[0], max(0, need - size - pads[0])


def _auto_pads(size: int, kernel: int, stride: int, dilation: int, mode: str) -> tuple[int, int]:
    """SAME_UPPER / SAME_LOWER padding (the extra element after / before)."""
    span = dilation * (kernel - 1) + 1
    total = max(0, (math.ceil(size / stride) - 1) * stride + span - size)
    small = total // 2
    return (small, total - small) if mode == "SAME_UPPER" else (total - small, small)


def max_pool_with_indices(bb: Any, x: Any, attr: Any) -> Any:
    """``(Y, Indices)`` of an N-D MaxPool of ``x`` (static spatial dims).

    Raises:
        BuildError: the input's spatial dims are not static.
    """
    import numpy as np
    import tvm
    from tvm import relax

    name = attr["tvm_custom"]["name"] or "<unnamed>"
    shape = list(x.ty.shape)
    spatial = shape[2:]
    if not all(isinstance(d, tvm.tirx.IntImm) for d in [*spatial, shape[1]]):
        raise BuildError(
            f"TVM cannot compute the Indices output of op 'MaxPool' at node {name!r} for an "
            f"input of shape {shape}: enginekit needs static channel and spatial dims. Fix "
            "them in the model, or build with another backend (e.g. --backend onnxruntime)."
        )
    sizes = [int(d) for d in spatial]
    rank = len(sizes)
    kernel = [int(k) for k in attr["kernel_shape"]]
    strides = [int(s) for s in attr.get("strides", [1] * rank)]
    dilations = [int(d) for d in attr.get("dilations", [1] * rank)]
    pads = [int(p) for p in attr.get("pads", [0] * 2 * rank)]
    mode = attr.get("auto_pad", b"NOTSET")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    geometry = []
    for i in range(rank):
        if mode in ("SAME_UPPER", "SAME_LOWER"):
            around = _auto_pads(sizes[i], kernel[i], strides[i], dilations[i], mode)
        elif mode == "VALID":
            around = (0, 0)
        else:
            around = (pads[i], pads[rank + i])
        ceil = int(attr.get("ceil_mode", 0)) != 0
        geometry.append(
            window_geometry(sizes[i], kernel[i], strides[i], dilations[i], around, ceil)
        )
    dtype = str(x.ty.dtype)
    low = float("-inf") if "float" in dtype else float(np.iinfo(dtype).min)
    widths = [0, 0, 0, 0] + [w for _, before, after in geometry for w in (before, after)]
    padded = bb.emit(relax.op.nn.pad(x, widths, pad_value=low))
    index = bb.emit(relax.op.nn.pad(_flat_index(bb, shape, attr), widths, pad_value=0.0))
    best = best_index = None
    axes = list(range(2, 2 + rank))
    for offset in itertools.product(*[range(k) for k in kernel]):
        begin = [o * d for o, d in zip(offset, dilations)]
        end = [b + (g[0] - 1) * s + 1 for b, g, s in zip(begin, geometry, strides)]
        window = bb.emit(relax.op.strided_slice(padded, axes, begin, end, strides))
        at = bb.emit(relax.op.strided_slice(index, axes, begin, end, strides))
        if best is None:
            best, best_index = window, at
            continue
        better = bb.emit(relax.op.greater(window, best))
        best = bb.emit(relax.op.where(better, window, best))
        best_index = bb.emit(relax.op.where(better, at, best_index))
    return relax.Tuple([best, best_index])


def _flat_index(bb: Any, shape: list[Any], attr: Any) -> Any:
    """An int64 tensor of ``shape``: each element's flat position, ``(n * C + c) * H * W``
    plus its spatial offset (row-major, or column-major with ``storage_order=1``)."""
    import numpy as np
    from tvm import relax

    channels = int(shape[1])
    sizes = [int(d) for d in shape[2:]]
    plane = int(np.prod(sizes))
    grid = np.arange(plane, dtype=np.int64).reshape(sizes)
    if int(attr.get("storage_order", 0)) == 1:
        # Column-major within the channel: the position of (h, w) is h + w * H.
        grid = np.arange(plane, dtype=np.int64).reshape(sizes[::-1]).T
    spatial = relax.const(grid.reshape([1, 1, *sizes]), "int64")
    batch = bb.emit(relax.op.arange(0, shape[0], 1, "int64"))
    batch = relax.op.reshape(batch, [shape[0], 1, *[1] * len(sizes)])
    lane = relax.const(
        np.arange(channels, dtype=np.int64).reshape([1, channels, *[1] * len(sizes)]), "int64"
    )
    base = relax.op.multiply(
        relax.op.add(relax.op.multiply(batch, relax.const(channels, "int64")), lane),
        relax.const(plane, "int64"),
    )
    return bb.emit(relax.op.add(base, spatial))
