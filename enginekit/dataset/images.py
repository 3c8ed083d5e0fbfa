"""Image preprocessing declared as data: decode, resize, center crop, scale, mean/std, layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.errors import DatasetError, UsageError

#: File suffixes an image folder source reads (lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


def _pair(value: int | Sequence[int] | None, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        pair = (value, value)
    else:
        pair = tuple(int(v) for v in value)  # type: ignore[assignment]
    if len(pair) != 2 or min(pair) < 1:
        raise UsageError(f"image {what}: expected a size >= 1 or (height, width), got {value!r}")
    return pair


@dataclasses.dataclass(frozen=True)
class ImagePreprocess:
    """How an image file becomes one row of an engine input (torchvision's usual recipe).

    Steps, in order: decode with Pillow and convert to ``mode``; ``resize`` (an int resizes the
    shorter side to it keeping the aspect ratio, ``(h, w)`` resizes to exactly that); center
    ``crop`` to ``(h, w)`` (or a square); multiply by ``scale``; subtract ``mean`` and divide by
    ``std`` per channel; lay out as ``"NCHW"`` or ``"NHWC"``; cast to ``dtype``.

    Example: ``ImagePreprocess(resize=256, crop=224, mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225))`` is the ImageNet evaluation transform.
    """

    resize: int | tuple[int, int] | None = None
    crop: int | tuple[int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    scale: float = 1 / 255
    layout: str = "NCHW"
    dtype: str = "float32"
    mode: str = "RGB"

    def __post_init__(self) -> None:
        if self.layout not in ("NCHW", "NHWC"):
            raise UsageError(f"image layout: expected 'NCHW' or 'NHWC', got {self.layout!r}")
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise UsageError(f"image dtype: {self.dtype!r} is not a numpy dtype") from None
        _pair(self.resize, "resize")
        _pair(self.crop, "crop")
        channels = len(self.mode) if self.mode in ("RGB", "RGBA", "L", "LA") else None
        for what, value in (("mean", self.mean), ("std", self.std)):
            if value is not None and channels and len(value) not in (1, channels):
                raise UsageError(
                    f"image {what}: {len(value)} values for mode {self.mode!r} with {channels} "
                    f"channel(s); give one value or {channels}"
                )
        if self.std is not None and any(s == 0 for s in self.std):
            raise UsageError(f"image std: a zero would divide by zero, got {self.std}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def channels(self) -> int:
        return {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}.get(self.mode, 3)

    def row_shape(self) -> tuple[int, int, int] | None:
        """The shape of one decoded row when the crop (or an exact resize) fixes it."""
        size = _pair(self.crop, "crop") or (
            _pair(self.resize, "resize") if not isinstance(self.resize, int) else None
        )
        if size is None:
            return None
        h, w = size
        return (self.channels, h, w) if self.layout == "NCHW" else (h, w, self.channels)

    def __call__(self, path: str | Path) -> np.ndarray:
        """Decode and preprocess one image file into one row."""
        return self.normalize(self.decode(path)[None])[0]

    def decode(self, path: str | Path) -> np.ndarray:
        """One image file decoded, converted, resized and cropped: uint8 (or the mode's
        type), height x width x channels, before scaling and layout."""
        from PIL import Image

        try:
            with Image.open(path) as f:
                im = self._crop(self._resize(f.convert(self.mode)))
                a = np.asarray(im)
        except (OSError, ValueError, SyntaxError) as exc:
            raise DatasetError(
                f"image {path}: cannot decode it ({exc}); remove or replace the file"
            ) from None
        return a[:, :, None] if a.ndim == 2 else a

    def normalize(self, batch: np.ndarray) -> np.ndarray:
        """Decoded images (N x H x W x C) scaled, standardized, laid out and typed: element by
        element, so a batch gives the same values as its images one at a time."""
        out_dtype = np.dtype(self.dtype)
        if self.mean is not None or self.std is not None or out_dtype.kind == "f":
            x = batch.astype(np.float32) * np.float32(self.scale)
            if self.mean is not None:
                x -= np.asarray(self.mean, np.float32)
            if self.std is not None:
                x /= np.asarray(self.std, np.float32)
        else:
            x = batch
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x, dtype=out_dtype)

    def _resize(self, im: Any) -> Any:
        from PIL import Image

        if self.resize is None:
            return im
        if isinstance(self.resize, int):
            w, h = im.size
            short = min(w, h)
            size = (max(1, round(w * self.resize / short)), max(1, round(h * self.resize / short)))
        else:
            h2, w2 = _pair(self.resize, "resize")  # type: ignore[misc]
            size = (w2, h2)
        return im.resize(size, Image.Resampling.BILINEAR)

    def _crop(self, im: Any) -> Any:
        size = _pair(self.crop, "crop")
        if size is None:
            return im
        ch, cw = size
        w, h = im.size
        if ch > h or cw > w:
            raise DatasetError(
                f"image of {w}x{h} is smaller than the crop {cw}x{ch}; resize it first "
                "(resize= / --resize) to at least the crop size"
            )
        left, top = (w - cw) // 2, (h - ch) // 2
        return im.crop((left, top, left + cw, top + ch))


def decode_many(preprocess: ImagePreprocess, paths: Sequence[str]) -> np.ndarray:
    """Decode a batch of image files into one array (run in a worker thread or process).

    The scaling and layout run once over the whole batch: per image, those small numpy calls
    cost about a third of a small image's decoding, holding the interpreter lock."""
    rows = [preprocess.decode(p) for p in paths]
    shapes = {r.shape for r in rows}
    if len(shapes) > 1:
        got = sorted(preprocess.normalize(r[None]).shape[1:] for r in rows)
        raise DatasetError(
            f"images decode to different shapes {sorted(set(got))}; declare a crop (or an exact "
            "(height, width) resize) so every image gives the same shape"
        )
    return preprocess.normalize(np.stack(rows))
