"""Make torchvision (and timm, which imports it) importable with a CPU-only torch.

PyPI's torchvision 0.28.0 wheel carries C++ ops built for a CUDA torch; with the CPU torch the
project pins, ``import torchvision`` fails with "operator torchvision::nms does not exist"
while registering the ops' fake kernels. Defining the two schemas first lets it import; the
models build and run (no NMS-based detection heads, whose kernels stay missing).
"""

from __future__ import annotations

from typing import Any

_LIB: Any = None


def torchvision() -> Any:
    """``import torchvision``, defining the missing op schemas first when needed."""
    global _LIB
    import torch

    if _LIB is None and not _has_nms(torch):
        _LIB = torch.library.Library("torchvision", "DEF")  # kept alive: the schemas live with it
        _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision as tv

    return tv


def timm() -> Any:
    """``import timm`` (it imports torchvision: the schemas are defined first)."""
    torchvision()
    import timm as tm

    return tm


def _has_nms(torch: Any) -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018 - resolving the attribute is the check
    except (AttributeError, RuntimeError):
        return False
    return True


def transformers() -> Any:
    """``import transformers`` (its vision code imports torchvision: schemas first)."""
    torchvision()
    import transformers as hf

    return hf
