"""A 3x3 NHWC conv + ReLU with a constant weight, lowered the way a build lowers it, and its numpy
reference: shared by the TVM schedule tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def fused_conv_relu(x: Any, w: np.ndarray) -> tuple[Any, Any]:
    """(fused module, target): `relu(conv2d(x, w, padding=1))` in NHWC/HWIO, legalized and fused
    for this host's CPU target, ready for `lower.apply_schedules`."""
    from tvm import relax

    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1, data_layout="NHWC",
                                           kernel_layout="HWIO"))  # fmt: skip
            out = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(out)
    return fuse(bb.get())


def fuse(mod: Any) -> tuple[Any, Any]:
    """(fused module, target): ``mod`` (Relax) legalized and fused for this host's CPU target
    the way a build does, ready for `lower.apply_schedules`."""
    import tvm
    from tvm import relax

    from enginekit.backends.tvm import lower

    target = lower.resolve_target(None, "cpu")
    with target:
        fused = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
            ]
        )(mod)
    return fused, target


def conv_relu_reference(
    data: np.ndarray, w: np.ndarray, residual: np.ndarray | None = None
) -> np.ndarray:
    """numpy's `relu(conv2d(data, w, padding=1) [+ residual])`, NHWC input, HWIO weight."""
    padded = np.pad(data, ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))
    y = np.einsum("nhwcij,ijco->nhwo", windows, w)
    return np.maximum(y if residual is None else y + residual, 0)
