"""``open_source``: the Source for a path (by its suffix, or what a folder holds) or an iterable."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset.imagefolder import ImageSource
from enginekit.dataset.images import IMAGE_SUFFIXES, ImagePreprocess
from enginekit.dataset.parquet import ParquetSource
from enginekit.dataset.sources import IterableSource, NumpySource, Source
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError, UsageError


def open_source(
    source: Any,
    inputs: Sequence[TensorSpec],
    *,
    columns: Mapping[str, str] | None = None,
    keep: Sequence[str] | None = None,
    preprocess: ImagePreprocess | None = None,
    decode_workers: int | None = None,
    decode_processes: bool = False,
    cast: bool = False,
) -> Source:
    """The Source for a path (Parquet, .npy/.npz or image file or folder) or an iterable."""
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        kind = _kind(path)
        if kind == "parquet":
            return ParquetSource(path, inputs, columns, keep, cast)
        if kind == "numpy":
            return NumpySource(path, inputs, columns, cast)
        return ImageSource(
            path, inputs, preprocess, columns, decode_workers, cast, decode_processes
        )
    if isinstance(source, (Iterable, np.ndarray)):
        batches = [source] if isinstance(source, np.ndarray) else source
        if isinstance(source, Mapping):
            batches = [source]
        return IterableSource(batches, inputs, columns, cast)
    raise UsageError(
        f"source: expected a path (Parquet, .npy/.npz or image file or folder) or an iterable of "
        f"batches, got {type(source).__name__}"
    )


def _kind(path: Path) -> str:
    if not path.exists():
        raise DatasetError(f"source {path}: no such file or folder; check the path")
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".parquet", ".parq", ".pq"):
            return "parquet"
        if suffix in (".npy", ".npz"):
            return "numpy"
        if suffix in IMAGE_SUFFIXES:
            return "images"
        raise DatasetError(
            f"source {path}: cannot tell its kind from the suffix {suffix!r}; use .parquet, "
            ".npy, .npz, an image, or a folder of them"
        )
    counts = {"parquet": 0, "numpy": 0, "images": 0}
    for p in itertools.islice(path.rglob("*"), 10000):
        s = p.suffix.lower()
        if s in (".parquet", ".parq", ".pq"):
            counts["parquet"] += 1
        elif s in (".npy", ".npz"):
            counts["numpy"] += 1
        elif s in IMAGE_SUFFIXES:
            counts["images"] += 1
    kind, n = max(counts.items(), key=lambda kv: kv[1])
    if n == 0:
        raise DatasetError(
            f"source folder {path} has no Parquet, .npy/.npz or image files; point at a folder "
            "that holds some"
        )
    return kind
