"""Where rows come from: Parquet files or folders, ``.npy``/``.npz`` files or folders, a folder of
images, or any iterable of batches. Each source yields *pieces* — id columns (Arrow arrays) and
engine inputs (numpy rows) — from a given row on, and names itself with a fingerprint so that a
resumed job can tell whether it still reads the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset.columns import check_rows, closest
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError, UsageError


@dataclasses.dataclass(frozen=True)
class Piece:
    """Consecutive rows: id columns (Arrow arrays) and engine inputs (numpy), all ``rows`` long."""

    ids: dict[str, Any]
    inputs: dict[str, np.ndarray]
    rows: int


class Source:
    """Rows for an engine. Subclasses fill in :meth:`pieces`."""

    description: str = ""
    fingerprint: str | None = None  # None: cannot tell whether a rerun reads the same rows
    rows: int | None = None  # total, when known up front
    files: tuple[Path, ...] = ()

    def pieces(self, start: int, size: int) -> Iterator[Piece]:
        """Rows from row ``start`` on, in pieces of about ``size`` rows."""
        raise NotImplementedError

    def close(self) -> None:
        """Release workers (image decoding)."""


def _row_ids(start: int, n: int) -> dict[str, Any]:
    import pyarrow as pa

    return {"row": pa.array(np.arange(start, start + n, dtype=np.int64))}


def file_fingerprint(files: Sequence[Path], root: Path, extra: Any = None) -> str:
    """SHA-256 over each file's path (relative to ``root``), size and modification time."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        rel = f.relative_to(root).as_posix() if f != root else f.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if extra is not None:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def list_files(path: Path, suffixes: Sequence[str], what: str) -> list[Path]:
    if not path.exists():
        raise DatasetError(f"source {path}: no such file or folder; check the path")
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in suffixes
        and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
    )
    if not files:
        raise DatasetError(
            f"source folder {path} has no {what} files ({', '.join(suffixes)}); point at a "
            "folder that holds some, or at a file"
        )
    return files


def _mapping(
    inputs: Sequence[TensorSpec],
    columns: Mapping[str, str] | None,
    available: Sequence[str],
    where: str,
) -> dict[str, str]:
    """input name -> column name, by name unless ``columns`` maps it; checked against ``available``."""
    columns = dict(columns or {})
    names = [s.name for s in inputs]
    for key in columns:
        if key not in names:
            raise UsageError(
                f"column mapping names input {key!r}, which the engine does not have"
                f"{closest(key, names)}; its inputs are {', '.join(map(repr, names))}"
            )
    mapping = {}
    for s in inputs:
        col = columns.get(s.name, s.name)
        if col not in available:
            raise DatasetError(
                f"{where} has no column {col!r} for engine input {s.name!r}"
                f"{closest(col, available)}; columns are {', '.join(map(repr, available))} — "
                f"map it with columns={{{s.name!r}: 'COLUMN'}} (--column {s.name}=COLUMN)"
            )
        mapping[s.name] = col
    return mapping


#: About this many bytes of input rows per Parquet read: large enough that per-read costs do
#: not grow with the number of batches, small enough that the memory pool reuses its buffers
#: instead of mapping fresh pages for every read (page faults showed up as system time).
READ_BYTES = 8 << 20


def read_rows(size: int, inputs: Sequence[TensorSpec]) -> int:
    """Rows per read: a whole number of batches (so batches are views, not joined copies),
    about :data:`READ_BYTES` of inputs."""
    row = 0
    for spec in inputs:
        dims = [d for d in spec.shape[1:] if isinstance(d, int)]
        row += np.dtype(spec.dtype).itemsize * int(np.prod(dims, dtype=np.int64))
    return size * max(1, READ_BYTES // max(1, row * size))


# -- .npy / .npz --------------------------------------------------------------------------------


def _npz_rows(path: Path) -> dict[str, tuple[int, ...]]:
    """Each member's shape, read from the headers (nothing is loaded)."""
    shapes = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            with z.open(name) as f:
                version = np.lib.format.read_magic(f)
                shape, _, _ = (
                    np.lib.format.read_array_header_1_0(f)
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0(f)
                )
            shapes[name.removesuffix(".npy")] = tuple(shape)
    return shapes


class NumpySource(Source):
    """``.npy`` files (rows of the one input) or ``.npz`` files (rows of every input by key), or
    a folder of either, read in sorted order as one sequence of rows."""

    def __init__(
        self,
        path: Path,
        inputs: Sequence[TensorSpec],
        columns: Mapping[str, str] | None,
        cast: bool,
    ) -> None:
        self.root = path
        self.files = tuple(list_files(path, (".npy", ".npz"), ".npy/.npz"))
        kinds = {f.suffix.lower() for f in self.files}
        if len(kinds) > 1:
            raise DatasetError(
                f"source folder {path} mixes .npy and .npz files; keep one kind per folder"
            )
        self.inputs = tuple(inputs)
        self.cast = cast
        self.npz = kinds == {".npz"}
        self._rows = []
        for f in self.files:
            try:
                if self.npz:
                    shapes = _npz_rows(f)
                    self.mapping = _mapping(inputs, columns, list(shapes), f"{f}")
                    counts = {shapes[c][0] if shapes[c] else 0 for c in self.mapping.values()}
                    if len(counts) != 1:
                        raise DatasetError(
                            f"{f}: the arrays for the engine's inputs have different row counts "
                            f"{sorted(counts)}; every input needs one row per sample"
                        )
                    self._rows.append(counts.pop())
                else:
                    if len(inputs) != 1:
                        raise DatasetError(
                            f"{f}: a .npy holds one array but the engine takes "
                            f"{len(inputs)} inputs ({', '.join(s.name for s in inputs)}); "
                            "use .npz files with one key per input"
                        )
                    self.mapping = {inputs[0].name: inputs[0].name}
                    a = np.load(f, mmap_mode="r", allow_pickle=False)
                    self._rows.append(a.shape[0] if a.ndim else 0)
            except DatasetError:
                raise
            except (OSError, ValueError, zipfile.BadZipFile) as exc:
                raise DatasetError(
                    f"{f}: cannot read it as {f.suffix} ({exc}); replace it or remove it"
                ) from None
        self.rows = sum(self._rows)
        self.fingerprint = file_fingerprint(self.files, path, {"columns": self.mapping})
        self.description = f"numpy:{path}"

    def pieces(self, start: int, size: int) -> Iterator[Piece]:
        row = 0
        for f, n in zip(self.files, self._rows):
            if row + n <= start:
                row += n
                continue
            try:
                if self.npz:
                    with np.load(f, allow_pickle=False) as z:
                        arrays = {i: z[c] for i, c in self.mapping.items()}
                else:
                    arrays = {self.inputs[0].name: np.load(f, mmap_mode="r", allow_pickle=False)}
            except (OSError, ValueError) as exc:
                raise DatasetError(
                    f"{f}: cannot read it ({exc}); replace it or remove it"
                ) from None
            lo = max(start - row, 0)
            for i in range(lo, n, size):
                j = min(i + size, n)
                feeds = {}
                for spec in self.inputs:
                    what = f"array {self.mapping[spec.name]!r} of {f} (rows {i}..{j})"
                    rows = np.ascontiguousarray(arrays[spec.name][i:j])
                    feeds[spec.name] = check_rows(spec, rows, what, self.cast)
                yield Piece(_row_ids(row + i, j - i), feeds, j - i)
            row += n


# -- Python iterables -----------------------------------------------------------------------------


class IterableSource(Source):
    """Any iterable of batches: dicts (inputs by name; other keys are carried as ids), arrays
    (single-input engines) or sequences in input order. Cannot be fingerprinted."""

    def __init__(
        self,
        batches: Iterable[Any],
        inputs: Sequence[TensorSpec],
        columns: Mapping[str, str] | None,
        cast: bool,
    ) -> None:
        self.inputs = tuple(inputs)
        self.columns = dict(columns or {})
        self.cast = cast
        self._it = iter(batches)
        self._peeked: list[Piece] = []
        self._used = False
        self._row = 0  # rows converted so far: the next piece's first row
        self.description = f"python:{type(batches).__name__}"

    def _convert(self, item: Any) -> Piece:
        import pyarrow as pa

        row = self._row
        names = [s.name for s in self.inputs]
        ids: dict[str, Any] = {}
        if isinstance(item, Mapping):
            mapping = _mapping(
                self.inputs, self.columns, [str(k) for k in item], f"batch at row {row}"
            )
            raw = {n: item[mapping[n]] for n in names}
            ids = {str(k): v for k, v in item.items() if k not in mapping.values()}
        elif isinstance(item, (list, tuple)):
            if len(item) != len(names):
                raise DatasetError(
                    f"batch at row {row}: a sequence of {len(item)} arrays for the engine's "
                    f"{len(names)} inputs ({', '.join(names)}); give one per input, in order"
                )
            raw = dict(zip(names, item))
        else:
            if len(names) != 1:
                raise DatasetError(
                    f"batch at row {row}: one array for an engine with {len(names)} inputs; "
                    "yield dicts name -> array"
                )
            raw = {names[0]: item}
        feeds = {}
        for spec in self.inputs:
            a = np.asarray(raw[spec.name])
            feeds[spec.name] = check_rows(
                spec, a, f"input {spec.name!r} of the batch at row {row}", self.cast
            )
        counts = {a.shape[0] for a in feeds.values()}
        if len(counts) != 1:
            raise DatasetError(
                f"batch at row {row}: inputs have different row counts {sorted(counts)}"
            )
        n = counts.pop()
        if ids:
            ids = {k: pa.array(np.asarray(v)) for k, v in ids.items()}
        else:
            ids = _row_ids(row, n)
        self._row += n
        return Piece(ids, feeds, n)

    def peek(self, rows: int) -> list[Piece]:
        """The first pieces holding at least ``rows`` rows (replayed by :meth:`pieces`)."""
        have = sum(p.rows for p in self._peeked)
        while have < rows:
            item = next(self._it, None)
            if item is None:
                break
            self._peeked.append(self._convert(item))
            have += self._peeked[-1].rows
        return list(self._peeked)

    def pieces(self, start: int, size: int) -> Iterator[Piece]:
        if self._used:
            raise DatasetError("an iterable source can be read once; pass a fresh iterable")
        self._used = True
        row = 0
        for piece in itertools.chain(self._peeked, map(self._convert, self._it)):
            if row + piece.rows <= start:
                row += piece.rows
                continue
            if row < start:
                piece = slice_piece(piece, start - row, piece.rows)
                row = start
            yield piece
            row += piece.rows


def slice_piece(p: Piece, lo: int, hi: int) -> Piece:
    """Rows ``lo:hi`` of a piece (views, no copies)."""
    return Piece(
        {k: v.slice(lo, hi - lo) for k, v in p.ids.items()},
        {k: v[lo:hi] for k, v in p.inputs.items()},
        hi - lo,
    )
