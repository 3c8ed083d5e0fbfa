"""Batch inference over datasets: sources in, an engine, committed shards out, resumable.

:func:`infer_dataset` runs locally with reading, the engine and writing overlapped;
:mod:`enginekit.dataset.ray` (``ek.ray``) scales the same engine out on Ray Data.
Heavy dependencies (pyarrow, Pillow, Ray) are imported when used.
"""

from __future__ import annotations

from enginekit.dataset.autobatch import BatchChoice, BatchTrial, choose_batch_size
from enginekit.dataset.images import ImagePreprocess
from enginekit.dataset.run import InferSummary, infer_dataset

__all__ = [
    "BatchChoice",
    "BatchTrial",
    "ImagePreprocess",
    "InferSummary",
    "choose_batch_size",
    "infer_dataset",
]
