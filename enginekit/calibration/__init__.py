"""INT8 calibration, once, on CPU: data -> per-tensor ranges -> what each backend consumes.

import enginekit as ek
table = ek.calibrate("model.onnx", data, method="entropy")      # -> CalibrationTable
table.save("calib.json")
engine = ek.build("model.onnx", precision="int8", calibration=table, shapes={...})

Writers (:mod:`enginekit.calibration.writers`) turn a table into a Q/DQ ONNX model (TensorRT
10/11, ONNX Runtime), TensorRT's legacy calibration cache, or ONNX Runtime's TensorRT EP table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from enginekit.calibration.collect import has_qdq, observe, weight_ranges
from enginekit.calibration.data import (
    DEFAULT_BATCH,
    Chunking,
    DataHash,
    Holdout,
    batches,
    fixed_batch,
)
from enginekit.calibration.observers import (
    DEFAULT_BINS,
    DEFAULT_PERCENTILE,
    METHODS,
    threshold,
)
from enginekit.calibration.table import CalibrationTable, TensorRange, WeightRange, as_table
from enginekit.config import ShapeProfile
from enginekit.errors import CalibrationError
from enginekit.model import ModelSource, load_model
from enginekit.progress import step

log = logging.getLogger(__name__)


def calibrate(
    model: ModelSource,
    data: Any,
    method: str = "entropy",
    *,
    percentile: float = DEFAULT_PERCENTILE,
    bins: int = DEFAULT_BINS,
    batch_size: int = DEFAULT_BATCH,
    max_samples: int | None = None,
    profile: Mapping[str, ShapeProfile] | None = None,
    remainder: str = "drop",
) -> CalibrationTable:
    """Calibrate a float ONNX model on representative data; CPU only, no GPU needed.

    Any number of rows works: a fixed-batch model gets them in chunks of its batch (the
    remainder dropped or padded, as ``remainder`` says, and recorded in ``table.chunking``);
    a dynamic-batch one in batches up to ``profile``'s max.

    Args:
        model: path to an ONNX file, a ModelProto or a Model.
        data: calibration data: an array, a dict of arrays, a .npz/.npy path or folder, or
            any iterable of batches (a torch DataLoader works); see
            :mod:`enginekit.calibration.data`.
        method: ``entropy`` (KL threshold, TensorRT's default), ``percentile`` or ``minmax``.
        percentile: the percentile of |x| kept by the ``percentile`` method.
        bins: histogram resolution (the entropy search runs over these bins).
        batch_size: rows per batch when ``data`` is a whole dataset in arrays.
        max_samples: stop after this many samples (e.g. for an endless generator).
        profile: input name -> ShapeProfile the data must fit (non-batch dims).
        remainder: fixed-batch models: ``drop`` (default) or ``pad`` the rows that do not
            fill a chunk (padded anyway when there is not one whole chunk).

    Returns:
        the CalibrationTable (save it with ``table.save("calib.json")``).

    Raises:
        CalibrationError: bad data (named input, expected, found), empty data, bad method.
    """
    return run(
        model, data, method, percentile=percentile, bins=bins, batch_size=batch_size,
        max_samples=max_samples, profile=profile, remainder=remainder,
    )  # fmt: skip


def run(
    model: ModelSource,
    data: Any,
    method: str = "entropy",
    *,
    percentile: float = DEFAULT_PERCENTILE,
    bins: int = DEFAULT_BINS,
    batch_size: int = DEFAULT_BATCH,
    max_samples: int | None = None,
    profile: Mapping[str, ShapeProfile] | None = None,
    holdout: Holdout | None = None,
    remainder: str = "drop",
) -> CalibrationTable:
    """:func:`calibrate`, optionally setting samples aside in ``holdout`` (for verification)."""
    if method not in METHODS:
        raise CalibrationError(f"calibration method {method!r} is not one of {', '.join(METHODS)}")
    if not 0 < percentile <= 100:
        raise CalibrationError(f"percentile={percentile}: expected a number in (0, 100]")
    m = load_model(model)
    if has_qdq(m.proto):
        raise CalibrationError(
            "the model already carries QuantizeLinear/DequantizeLinear nodes (quantization-aware "
            "training?): its scales are in the model, there is nothing to calibrate. Build it "
            "with precision='int8' and no calibration"
        )
    digest = DataHash()

    def hashed(stream: Any) -> Any:
        for feeds in stream:
            digest.update(feeds)
            yield feeds

    chunking = Chunking()
    # A fixed-batch model: rows are set aside first, then the rest cut to the model's batch.
    late = holdout is not None and fixed_batch(m.inputs) is not None
    stream = hashed(
        batches(data, m.inputs, batch_size, max_samples, profile, remainder, chunking, not late)
    )
    if holdout is not None:
        stream = holdout.split(stream)
    if late:
        stream = batches(stream, m.inputs, batch_size, None, profile, remainder, chunking)

    def report(count: int, samples: int) -> None:
        log.info("calibration batch %d (%d samples so far)", count, samples)

    with step(f"calibrating ({method})"):
        observers, samples, count = observe(
            m, stream, histogram=method != "minmax", bins=bins, on_batch=report
        )
        tensors = {}
        for name, obs in observers.items():
            hist = obs.histogram()
            amax = threshold(method, obs.min, obs.max, hist, percentile)
            tensors[name] = TensorRange(obs.min, obs.max, amax, hist)
    return CalibrationTable(
        method=method,
        tensors=tensors,
        weights=weight_ranges(m.proto),
        model_sha256=m.sha256,
        data_sha256=digest.hexdigest(),
        samples=samples,
        batches=count,
        percentile=float(percentile),
        bins=bins,
        chunking=chunking.note(),
    )


__all__ = [
    "METHODS",
    "CalibrationTable",
    "TensorRange",
    "WeightRange",
    "as_table",
    "calibrate",
    "has_qdq",
]
