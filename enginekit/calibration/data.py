"""Calibration data sources, read one batch at a time and checked against the model's inputs.

Accepted sources (``data=``):

- a numpy array (or anything with ``__array__``/``__dlpack__``, e.g. a torch tensor) holding
  the whole dataset of a single-input model: split into batches of ``batch_size`` rows;
- a dict input name -> such arrays: the whole dataset of a model with several inputs;
- a path to a ``.npz`` file (one key per input), a ``.npy`` file (single input), or a folder
  holding either ``<input name>.npy`` per input (memory-mapped: only one batch is ever read
  in), or batch files ``*.npy`` (single input) / ``*.npz`` (one key per input), read in name
  order;
- any other iterable of batches (a list, a generator, a torch ``DataLoader``): each item is a
  dict name -> array, a tuple/list in input order (trailing extras such as labels are
  ignored), or one array for a single-input model.

An item with one dim fewer than its input is one sample (a batch of 1). Dtypes must match the
model's exactly: enginekit never casts silently.

Any number of rows works with any model: for a model with a fixed batch (a model-zoo file of
batch 1), the rows are re-cut into chunks of exactly that batch, across the source's own
batches; a remainder that does not fill a chunk is dropped (``remainder="drop"``, the default)
or padded by repeating rows (``remainder="pad"``, and always when there is not one whole
chunk), and said in a warning and in :class:`Chunking`. For a dynamic batch with a build
profile, batches larger than the profile's max are split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec, to_numpy
from enginekit.errors import CalibrationError, EngineInputError

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]
DEFAULT_BATCH = 32


def _is_array(value: Any) -> bool:
    return (
        isinstance(value, np.ndarray) or hasattr(value, "__array__") or hasattr(value, "__dlpack__")
    )


def _array(value: Any, name: str) -> np.ndarray:
    try:
        return to_numpy(value, name)
    except EngineInputError as exc:
        raise CalibrationError(f"calibration data: {exc}") from None


def _rows(arrays: Mapping[str, np.ndarray], batch_size: int) -> Iterator[dict[str, Any]]:
    """Split dataset-level arrays (all with the same number of rows) into batches."""
    sizes = {n: (a.shape[0] if a.ndim else None) for n, a in arrays.items()}
    counts = set(sizes.values())
    if None in counts:
        scalar = next(n for n, s in sizes.items() if s is None)
        raise CalibrationError(
            f"calibration data for input {scalar!r} is a scalar; expected an array with one "
            "row per sample"
        )
    if len(counts) > 1:
        listing = ", ".join(f"{n}: {s}" for n, s in sizes.items())
        raise CalibrationError(
            f"calibration arrays have different numbers of rows ({listing}); each input needs "
            "one row per sample"
        )
    total = int(counts.pop() or 0) if counts else 0
    for start in range(0, total, batch_size):
        yield {n: a[start : start + batch_size] for n, a in arrays.items()}


def _from_path(path: Path, names: Sequence[str], batch_size: int) -> Iterator[Any]:
    if path.is_dir():
        yield from _from_folder(path, names, batch_size)
        return
    if not path.is_file():
        raise CalibrationError(f"calibration data {path}: no such file or folder")
    if path.suffix == ".npz":
        with _load(path) as npz:
            yield from _rows({k: npz[k] for k in npz.files}, batch_size)
    elif path.suffix == ".npy":
        if len(names) != 1:
            raise CalibrationError(
                f"calibration data {path}: one .npy array, but the model has {len(names)} "
                f"inputs ({', '.join(names)}); use a .npz with one key per input"
            )
        yield from _rows({names[0]: _load(path, mmap_mode="r")}, batch_size)
    else:
        raise CalibrationError(
            f"calibration data {path}: expected a .npz or .npy file or a folder of them"
        )


def _load(path: Path, **kwargs: Any) -> Any:
    try:
        return np.load(path, allow_pickle=False, **kwargs)
    except (OSError, ValueError) as exc:
        raise CalibrationError(
            f"calibration data {path}: not a readable numpy file: {exc}"
        ) from None


def _from_folder(folder: Path, names: Sequence[str], batch_size: int) -> Iterator[Any]:
    per_input = [folder / f"{n}.npy" for n in names]
    if all(p.is_file() for p in per_input):
        arrays = {n: _load(p, mmap_mode="r") for n, p in zip(names, per_input)}
        yield from _rows(arrays, batch_size)
        return
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz"))
    if not files:
        raise CalibrationError(
            f"calibration data {folder}: the folder holds no .npy or .npz files (expected "
            f"{' + '.join(n + '.npy' for n in names)}, or one batch file per batch)"
        )
    for p in files:
        if p.suffix == ".npz":
            with _load(p) as npz:
                yield {k: npz[k] for k in npz.files}
        elif len(names) == 1:
            yield _load(p)
        else:
            raise CalibrationError(
                f"calibration data {p}: a .npy batch file, but the model has {len(names)} "
                f"inputs ({', '.join(names)}); store each batch as a .npz with one key per "
                f"input, or give {' + '.join(n + '.npy' for n in names)}"
            )


def raw_batches(source: Any, names: Sequence[str], batch_size: int) -> Iterator[Any]:
    """The source as an iterator of unchecked batches (see the module docs for the forms)."""
    if isinstance(source, (str, os.PathLike)):
        yield from _from_path(Path(source), names, batch_size)
    elif isinstance(source, Mapping):
        yield from _rows({str(k): _array(v, str(k)) for k, v in source.items()}, batch_size)
    elif _is_array(source):
        if len(names) != 1:
            raise CalibrationError(
                f"calibration data is one array, but the model has {len(names)} inputs "
                f"({', '.join(names)}); pass a dict input name -> array"
            )
        yield from _rows({names[0]: _array(source, names[0])}, batch_size)
    elif isinstance(source, Iterable):
        yield from source
    else:
        raise CalibrationError(
            f"calibration data of type {type(source).__name__} is not supported; pass an "
            "array, a dict of arrays, a .npz/.npy path or folder, or an iterable of batches"
        )


def normalize(
    item: Any,
    specs: Sequence[TensorSpec],
    profile: Mapping[str, ShapeProfile] | None = None,
    any_rows: bool = False,
) -> Feeds:
    """One batch as ``{input name: array}``, checked against the model's input specs.

    Raises:
        CalibrationError: a missing or unknown name, a wrong dtype or rank, a fixed dim that
            differs, a dim outside the profile, or inputs that disagree on the batch size.
    """
    names = [s.name for s in specs]
    if isinstance(item, Mapping):
        missing = [n for n in names if n not in item]
        extra = [str(k) for k in item if k not in names]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"unknown input(s) {', '.join(map(repr, extra))}")
            raise CalibrationError(
                "calibration batch: " + "; ".join(parts) + f" — the model takes "
                f"{', '.join(map(repr, names))}"
            )
        values = [item[n] for n in names]
    elif isinstance(item, (tuple, list)):
        if len(item) < len(names):
            raise CalibrationError(
                f"calibration batch: a sequence of {len(item)} item(s), but the model takes "
                f"{len(names)} inputs in order ({', '.join(names)})"
            )
        values = list(item[: len(names)])
    elif len(names) == 1:
        values = [item]
    else:
        raise CalibrationError(
            f"calibration batch: one array, but the model has {len(names)} inputs "
            f"({', '.join(names)}); yield dicts name -> array or tuples in that order"
        )
    feeds = {}
    for spec, value in zip(specs, values):
        feeds[spec.name] = _check_dims(spec, _array(value, spec.name), profile, any_rows)
    rows = {a.shape[0] for a in feeds.values() if a.ndim}
    if len(rows) > 1:
        listing = ", ".join(f"{n}: {a.shape}" for n, a in feeds.items())
        raise CalibrationError(f"calibration batch: inputs disagree on the batch size ({listing})")
    return feeds


def _check(
    spec: TensorSpec, array: np.ndarray, profile: Mapping[str, ShapeProfile] | None
) -> np.ndarray:
    return _check_dims(spec, array, profile, any_rows=False)


def _check_dims(
    spec: TensorSpec, array: np.ndarray, profile: Mapping[str, ShapeProfile] | None, any_rows: bool
) -> np.ndarray:
    expected = np.dtype(spec.dtype)
    if array.dtype != expected:
        raise CalibrationError(
            f"calibration data for input {spec.name!r}: dtype {array.dtype}, the model takes "
            f"{expected} (convert it, e.g. x.astype(np.{expected}); enginekit never casts "
            "silently)"
        )
    rank = len(spec.shape)
    if array.ndim == rank - 1 and rank and not isinstance(spec.shape[0], int):
        fits = all(not isinstance(w, int) or d == w for d, w in zip(array.shape, spec.shape[1:]))
        if fits:
            array = array[None]  # one sample without its batch axis
    if array.ndim != rank:
        raise CalibrationError(
            f"calibration data for input {spec.name!r}: shape {array.shape} (rank "
            f"{array.ndim}), the model takes rank {rank} {_shape_text(spec)}"
        )
    for axis, (d, want) in enumerate(zip(array.shape, spec.shape)):
        if axis == 0 and any_rows:
            continue  # re-cut to the model's batch afterwards
        if isinstance(want, int) and d != want:
            raise CalibrationError(
                f"calibration data for input {spec.name!r}: shape {array.shape}, dim {axis} "
                f"must be {want} (the model's input is {_shape_text(spec)})"
            )
    if profile and spec.name in profile:
        prof = profile[spec.name]
        # The batch dim may be anything: calibration runs the float model, which takes any size.
        for axis in range(1, rank):
            if not prof.min[axis] <= array.shape[axis] <= prof.max[axis]:
                raise CalibrationError(
                    f"calibration data for input {spec.name!r}: shape {array.shape}, dim {axis} "
                    f"is outside the build profile {prof.min[axis]}..{prof.max[axis]}"
                )
    return array


def _shape_text(spec: TensorSpec) -> str:
    return "[" + ", ".join(str(d) for d in spec.shape) + "]"


REMAINDERS = ("drop", "pad")


@dataclasses.dataclass
class Chunking:
    """How the rows were cut to the batch the model takes (filled in while batches stream).

    Attributes:
        size: the model's fixed batch, or the profile's max batch (None: no limit).
        fixed: the model's batch is fixed (chunks are exactly ``size`` rows).
        remainder: ``drop`` or ``pad``: what happens to rows that do not fill a chunk.
        rows: rows read from the source; dropped / padded: rows dropped, rows added by padding.
    """

    size: int | None = None
    fixed: bool = False
    remainder: str = "drop"
    rows: int = 0
    dropped: int = 0
    padded: int = 0

    def note(self) -> str:
        """One line for warnings and the manifest; empty when nothing was re-cut."""
        if not self.fixed or not (self.dropped or self.padded or self.rows % (self.size or 1)):
            return ""
        what = f"dropped the last {self.dropped}" if self.dropped else f"padded {self.padded}"
        return (
            f"the model's batch is fixed at {self.size}: {self.rows} rows cut into chunks of "
            f"{self.size}; {what} row(s) ({'repeated rows' if self.padded else 'remainder'})"
        )


def fixed_batch(specs: Sequence[TensorSpec]) -> int | None:
    """The model's fixed leading batch when every input has the same int dim 0, else None."""
    leads = {s.shape[0] if s.shape else None for s in specs}
    if len(leads) == 1:
        lead = leads.pop()
        return lead if isinstance(lead, int) else None
    return None


def _max_batch(
    specs: Sequence[TensorSpec], profile: Mapping[str, ShapeProfile] | None
) -> int | None:
    if not profile:
        return None
    sizes = [profile[s.name].max[0] for s in specs if s.name in profile and profile[s.name].max]
    return min(sizes) if sizes else None


def _recut(stream: Iterable[Feeds], chunking: Chunking) -> Iterator[Feeds]:
    """Re-cut batches into chunks of exactly ``chunking.size`` rows (fixed batch)."""
    size = int(chunking.size or 1)
    pending: list[Feeds] = []
    held = emitted = 0
    for feeds in stream:
        rows = _rows_of(feeds)
        chunking.rows += rows
        pending.append(feeds)
        held += rows
        while held >= size:
            joined = {n: np.concatenate([p[n] for p in pending]) for n in pending[0]}
            yield {n: a[:size] for n, a in joined.items()}
            emitted += 1
            rest = {n: a[size:] for n, a in joined.items()}
            held -= size
            pending = [rest] if held else []
    if not held:
        return
    if chunking.remainder == "pad" or emitted == 0:
        joined = {n: np.concatenate([p[n] for p in pending]) for n in pending[0]}
        index = np.arange(size) % held
        chunking.padded = size - held
        yield {n: a[index] for n, a in joined.items()}
    else:
        chunking.dropped = held


def _split(stream: Iterable[Feeds], chunking: Chunking) -> Iterator[Feeds]:
    """Split batches larger than ``chunking.size`` (the profile's max batch)."""
    size = int(chunking.size or 1)
    for feeds in stream:
        rows = _rows_of(feeds)
        chunking.rows += rows
        for start in range(0, rows, size):
            yield {n: a[start : start + size] for n, a in feeds.items()}


def batches(
    source: Any,
    specs: Sequence[TensorSpec],
    batch_size: int = DEFAULT_BATCH,
    max_samples: int | None = None,
    profile: Mapping[str, ShapeProfile] | None = None,
    remainder: str = "drop",
    chunking: Chunking | None = None,
    recut: bool = True,
) -> Iterator[Feeds]:
    """Checked batches from any accepted source, stopping after ``max_samples`` samples, cut
    to the batch the model takes (see the module docs).

    Args:
        remainder: for a fixed-batch model, ``drop`` or ``pad`` the rows that do not fill a
            chunk (padded anyway when there is not one whole chunk).
        chunking: filled in with what the cutting did (for the manifest); a warning says it too.
        recut: False leaves a fixed-batch model's rows uncut (any count per batch), for a
            caller that cuts them later (after setting some aside).

    Raises:
        CalibrationError: a malformed source or batch (see :func:`normalize`).
    """
    if batch_size < 1:
        raise CalibrationError(f"batch_size={batch_size}: expected at least 1")
    if max_samples is not None and max_samples < 1:
        raise CalibrationError(f"max_samples={max_samples}: expected at least 1")
    if remainder not in REMAINDERS:
        raise CalibrationError(f"remainder={remainder!r}: expected one of {', '.join(REMAINDERS)}")
    chunking = chunking if chunking is not None else Chunking()
    chunking.remainder = remainder
    fixed = fixed_batch(specs)
    chunking.fixed = fixed is not None
    chunking.size = fixed if fixed is not None else _max_batch(specs, profile)
    if fixed is not None:
        batch_size = max(batch_size - batch_size % fixed, fixed)  # whole chunks per read
    elif chunking.size is not None:
        batch_size = min(batch_size, chunking.size)
    names = [s.name for s in specs]

    def checked() -> Iterator[Feeds]:
        seen = 0
        for item in raw_batches(source, names, batch_size):
            feeds = normalize(item, specs, profile, any_rows=fixed is not None)
            rows = _rows_of(feeds)
            if rows == 0:
                continue
            if max_samples is not None and seen + rows > max_samples:
                keep = max_samples - seen
                feeds = {n: a[:keep] for n, a in feeds.items()}
                rows = keep
            # Memory-mapped slices become real arrays here, one batch at a time.
            yield {n: np.ascontiguousarray(a) for n, a in feeds.items()}
            seen += rows
            if max_samples is not None and seen >= max_samples:
                return

    if fixed is not None and not recut:
        yield from checked()
    elif fixed is not None:
        yield from _recut(checked(), chunking)
        if chunking.note():
            log.warning("calibration data: %s", chunking.note())
    elif chunking.size is not None:
        yield from _split(checked(), chunking)
    else:
        for feeds in checked():
            chunking.rows += _rows_of(feeds)
            yield feeds


def _rows_of(feeds: Feeds) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


class DataHash:
    """SHA-256 over batches in order: each input's name, dtype, shape and bytes."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, feeds: Feeds) -> None:
        for name, a in feeds.items():
            self._h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            self._h.update(np.ascontiguousarray(a).tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Holdout:
    """Set aside every ``every``-th sample (up to ``cap``) for verification; pass the rest on.

    With ``first=n``, every 2nd sample is held out until ``n`` are (the first ``2 * n``
    samples), then every ``every``-th: a short data set still gives ``n`` held-out rows. The
    accuracy search needs that: 30 rows (every 10th of 300) cannot tell 97% from 100% (a
    97% target on 30 rows demands all 30), so plans were chosen on a fluke.

    With ``fit=n``, the first ``n`` samples passed on (the calibration, or *fitting*, rows)
    are also kept, in ``fitted``: the accuracy search estimates what it fits (bias
    correction's channel means, the sensitivity ranking) on them, never on the held-out rows it
    scores plans on, so that the agreement it reports is not flattered by its own fitting.

    Streaming: works on sources of unknown length, and decides per sample, so it holds out the
    same samples whatever the batch sizes are.
    """

    def __init__(self, every: int = 10, cap: int = 512, first: int = 0, fit: int = 0) -> None:
        self.every = every
        self.cap = cap
        self.first = first
        self.fit = fit
        self.held: list[Feeds] = []
        self.fitted: list[Feeds] = []
        self.count = 0
        self.fit_count = 0
        self._index = 0

    def split(self, stream: Iterable[Feeds]) -> Iterator[Feeds]:
        """Yield each batch without its held-out rows (batches left empty are skipped)."""
        for feeds in stream:
            rows = _rows_of(feeds)
            index = np.arange(self._index, self._index + rows)
            self._index += rows
            hold = (index % self.every) == self.every - 1 if self.every > 0 else index < 0
            early = index < 2 * self.first
            hold = np.where(early, index % 2 == 1, hold)
            room = self.cap - self.count
            if hold.sum() > room:
                hold[np.flatnonzero(hold)[room:]] = False
            if hold.any():
                self.held.append({n: a[hold] for n, a in feeds.items()})
                self.count += int(hold.sum())
            if not hold.all():
                rest = {n: a[~hold] for n, a in feeds.items()} if hold.any() else feeds
                keep = min(self.fit - self.fit_count, _rows_of(rest))
                if keep > 0:  # copies: the batch's arrays may be reused by the source
                    self.fitted.append({n: np.array(a[:keep]) for n, a in rest.items()})
                    self.fit_count += keep
                yield rest
