"""CalibrationTable: the backend-neutral result of calibration, saved as JSON.

Per activation tensor: min, max, the method's symmetric threshold ``amax`` and (for the
histogram methods) the |x| histogram, so another method can be applied later without the data
(:meth:`CalibrationTable.with_method`). Per weight: per-output-channel ``amax``. Plus what the
table was made from: the method, the model's SHA-256 and a SHA-256 of the calibration data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.calibration.observers import (
    DEFAULT_BINS,
    DEFAULT_PERCENTILE,
    METHODS,
    Histogram,
    threshold,
)
from enginekit.errors import CalibrationError

#: Version of the table's JSON layout; bump on incompatible change.
FORMAT_VERSION = 1
FORMAT_NAME = "enginekit-calibration"
#: Largest magnitude of symmetric int8 (-127..127; -128 unused so that zero stays centred).
INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class TensorRange:
    """What calibration saw of one activation tensor, and the threshold it chose.

    Attributes:
        min, max: smallest and largest value over all calibration batches.
        amax: symmetric clipping threshold chosen by the method (``<= max(|min|, |max|)``).
        histogram: |x| histogram (None for a MinMax table).
    """

    min: float
    max: float
    amax: float
    histogram: Histogram | None = None

    @property
    def scale(self) -> float:
        """Symmetric int8 scale ``amax / 127`` (1.0 for a tensor that was always 0)."""
        return self.amax / INT8_MAX if self.amax > 0 else 1.0

    def clipped_range(self) -> tuple[float, float]:
        """``[min, max]`` clipped to ``[-amax, amax]``: the range for asymmetric quantization."""
        return max(self.min, -self.amax), min(self.max, self.amax)

    def to_json(self, histogram: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"min": self.min, "max": self.max, "amax": self.amax}
        if histogram and self.histogram is not None:
            out["histogram"] = self.histogram.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorRange:
        lo, hi, amax = (float(data[k]) for k in ("min", "max", "amax"))
        if not all(math.isfinite(v) for v in (lo, hi, amax)) or lo > hi or amax < 0:
            raise ValueError(f"min={lo}, max={hi}, amax={amax} is not a valid range")
        hist = data.get("histogram")
        return cls(lo, hi, amax, Histogram.from_json(hist) if hist is not None else None)


@dataclasses.dataclass(frozen=True)
class WeightRange:
    """Per-channel symmetric range of one weight initializer: ``amax[c]`` along ``axis``."""

    axis: int
    amax: tuple[float, ...]

    @property
    def scales(self) -> np.ndarray:
        """Per-channel int8 scales ``amax / 127`` (1.0 where a channel is all zeros)."""
        a = np.asarray(self.amax, np.float32)
        return np.where(a > 0, a / INT8_MAX, 1.0).astype(np.float32)

    def to_json(self) -> dict[str, Any]:
        return {"axis": self.axis, "amax": list(self.amax)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightRange:
        amax = tuple(float(v) for v in data["amax"])
        if not all(math.isfinite(v) and v >= 0 for v in amax):
            raise ValueError("weight amax values must be finite numbers >= 0")
        return cls(int(data["axis"]), amax)


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationTable:
    """Per-tensor ranges from calibration, tied to one model.

    Attributes:
        method: ``minmax``, ``entropy`` or ``percentile``.
        tensors: activation tensor name -> TensorRange.
        weights: weight initializer name -> per-channel WeightRange.
        model_sha256: SHA-256 of the model calibrated (enginekit's ``Model.sha256``).
        data_sha256: SHA-256 of the calibration batches (names, dtypes, shapes, bytes).
        samples, batches: how much data was seen.
        percentile: the percentile used by the ``percentile`` method.
        bins: histogram resolution used.
        chunking: how the rows were cut to a fixed-batch model's batch, and what was dropped
            or padded (empty when nothing was).
    """

    method: str
    tensors: Mapping[str, TensorRange]
    weights: Mapping[str, WeightRange]
    model_sha256: str
    data_sha256: str
    samples: int
    batches: int
    percentile: float = DEFAULT_PERCENTILE
    bins: int = DEFAULT_BINS
    chunking: str = ""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CalibrationError(
                f"calibration method {self.method!r} is not one of {', '.join(METHODS)}"
            )

    # -- lookups -------------------------------------------------------------------------------

    def amax(self, name: str) -> float:
        """The symmetric threshold of activation ``name``."""
        return self[name].amax

    def scale(self, name: str) -> float:
        """The symmetric int8 scale of activation ``name``."""
        return self[name].scale

    def __getitem__(self, name: str) -> TensorRange:
        try:
            return self.tensors[name]
        except KeyError:
            raise CalibrationError(
                f"the calibration table has no tensor {name!r} ({len(self.tensors)} tensors); "
                "was it made for this model?"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return (
            f"<CalibrationTable {self.method} {len(self.tensors)} tensors, {len(self.weights)} "
            f"weights, {self.samples} samples, model {self.model_sha256[:12]}>"
        )

    # -- identity ------------------------------------------------------------------------------

    @property
    def sha256(self) -> str:
        """SHA-256 of the table's canonical JSON (histograms included): its identity in
        manifests and build keys."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def check_model(self, model_sha256: str, allow_mismatch: bool = False) -> None:
        """Refuse a table made for another model, unless ``allow_mismatch``.

        Raises:
            CalibrationError: the model hashes differ.
        """
        if self.model_sha256 == model_sha256 or allow_mismatch:
            return
        raise CalibrationError(
            f"this calibration table was made for model {self.model_sha256[:16]}…, not for this "
            f"model ({model_sha256[:16]}…). Calibrate this model (enginekit calibrate), or pass "
            "allow_table_mismatch=True (CLI: --allow-table-mismatch) if only its weights changed "
            "and its tensor names are the same"
        )

    def manifest_entry(self) -> dict[str, Any]:
        """What an engine's manifest records of the table it was built with."""
        return {
            "sha256": self.sha256,
            "method": self.method,
            "percentile": self.percentile if self.method == "percentile" else None,
            "tensors": len(self.tensors),
            "samples": self.samples,
            "data_sha256": self.data_sha256,
            "model_sha256": self.model_sha256,
            **({"chunking": self.chunking} if self.chunking else {}),
        }

    # -- other methods from the same histograms ------------------------------------------------

    def with_method(self, method: str, percentile: float | None = None) -> CalibrationTable:
        """The same observations with another method's thresholds (no data needed).

        Raises:
            CalibrationError: the table has no histograms (MinMax) and the method needs them.
        """
        pct = self.percentile if percentile is None else float(percentile)
        tensors = {
            name: dataclasses.replace(r, amax=threshold(method, r.min, r.max, r.histogram, pct))
            for name, r in self.tensors.items()
        }
        return dataclasses.replace(self, method=method, tensors=tensors, percentile=pct)

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self, histograms: bool = True) -> dict[str, Any]:
        """A JSON-safe dict; :meth:`from_json` reads it back into an equal table."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "method": self.method,
            "percentile": self.percentile,
            "bins": self.bins,
            "model_sha256": self.model_sha256,
            "data_sha256": self.data_sha256,
            "samples": self.samples,
            "batches": self.batches,
            "tensors": {n: r.to_json(histograms) for n, r in self.tensors.items()},
            "weights": {n: w.to_json() for n, w in self.weights.items()},
            **({"chunking": self.chunking} if self.chunking else {}),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration table") -> CalibrationTable:
        """Inverse of :meth:`to_json`.

        Raises:
            CalibrationError: not a table, a newer format, or a malformed entry (named).
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT_NAME:
            raise CalibrationError(
                f'{source}: not an enginekit calibration table (no "format": '
                f'"{FORMAT_NAME}"); make one with enginekit calibrate'
            )
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CalibrationError(
                f"{source}: table format version {version!r}; this enginekit reads version "
                f"{FORMAT_VERSION}. Recalibrate with this enginekit"
            )
        try:
            tensors = {str(n): TensorRange.from_json(r) for n, r in data["tensors"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(f"{source}: malformed tensor entry: {exc}") from None
        try:
            weights = {str(n): WeightRange.from_json(w) for n, w in data["weights"].items()}
            return cls(
                method=str(data["method"]),
                tensors=tensors,
                weights=weights,
                model_sha256=str(data["model_sha256"]),
                data_sha256=str(data["data_sha256"]),
                samples=int(data["samples"]),
                batches=int(data["batches"]),
                percentile=float(data["percentile"]),
                bins=int(data["bins"]),
                chunking=str(data.get("chunking", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(
                f"{source}: malformed table ({type(exc).__name__}: {exc})"
            ) from None

    def save(self, path: str | os.PathLike, histograms: bool = True) -> Path:
        """Write the table as JSON (atomically: a crash never leaves half a file).

        Args:
            histograms: keep the histograms (needed by :meth:`with_method`; most of the size).
        """
        path = Path(path)
        text = _dumps(self.to_json(histograms))
        # A sibling temp file (normal permissions, same filesystem), renamed into place.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationTable:
        """Read a table written by :meth:`save`.

        Raises:
            CalibrationError: missing file, not JSON, not a table, or malformed.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot read the calibration table: {exc}") from None
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CalibrationError(
                f"{path}: not valid JSON ({exc}); the file is corrupt or truncated. Recalibrate: "
                "enginekit calibrate <model.onnx> --data <data> -o " + str(path)
            ) from None
        return cls.from_json(data, source=str(path))


def _dumps(data: Mapping[str, Any]) -> str:
    """JSON with one line per key, and per tensor/weight entry: readable, and compact even with
    thousands of histogram counts."""
    lines = []
    for key, value in data.items():
        if isinstance(value, Mapping) and key in ("tensors", "weights"):
            entries = [
                f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                for k, v in value.items()
            ]
            body = "{\n" + ",\n".join(entries) + "\n }" if entries else "{}"
            lines.append(f" {json.dumps(key)}: {body}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def as_table(source: CalibrationTable | str | os.PathLike) -> CalibrationTable:
    """A CalibrationTable from a table or the path of its JSON file."""
    if isinstance(source, CalibrationTable):
        return source
    if isinstance(source, (str, os.PathLike)):
        return CalibrationTable.load(source)
    raise CalibrationError(
        f"calibration=: expected a CalibrationTable or the path of its JSON, got "
        f"{type(source).__name__}"
    )
