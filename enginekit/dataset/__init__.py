"""Batch inference over datasets: sources in, an engine, committed shards out, resumable.

:func:`infer_dataset` runs locally with reading, the engine and writing overlapped;
:mod:`enginekit.dataset.ray` (``ek.ray``) scales the same engine out on Ray Data.
Heavy dependencies (pyarrow, Pillow, Ray) are imported when used, and so are this package's own
modules: a Ray Data actor imports ``enginekit.dataset.ray`` in each new worker process, and
needs neither the local pipeline nor the batch-size search.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginekit.dataset.autobatch import BatchChoice, BatchTrial, choose_batch_size
    from enginekit.dataset.images import ImagePreprocess
    from enginekit.dataset.run import InferSummary, infer_dataset

_LAZY = {
    "BatchChoice": "enginekit.dataset.autobatch",
    "BatchTrial": "enginekit.dataset.autobatch",
    "choose_batch_size": "enginekit.dataset.autobatch",
    "ImagePreprocess": "enginekit.dataset.images",
    "InferSummary": "enginekit.dataset.run",
    "infer_dataset": "enginekit.dataset.run",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'enginekit.dataset' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchChoice",
    "BatchTrial",
    "ImagePreprocess",
    "InferSummary",
    "choose_batch_size",
    "infer_dataset",
]
