"""Parquet sources: files or folders of them, columns to engine inputs by name.

Tensor columns (fixed-size lists, nested or not, and Arrow's fixed-shape tensor extension type)
of the plain numeric types are read by :mod:`enginekit.dataset.pages`, straight from the data
pages into the batch's array (no per-value list rebuilding; with cramjam, PLAIN pages are
decompressed in place, else decompressed and copied once); every other column, and
any row group that reader refuses (nulls, an encoding it does not handle), is read by pyarrow.
Both give the same rows.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset import pages
from enginekit.dataset.columns import check_rows, closest, is_id_type, to_numpy
from enginekit.dataset.sources import (
    Piece,
    Source,
    _mapping,
    _row_ids,
    file_fingerprint,
    list_files,
    read_rows,
)
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError

#: One-batch pieces a Parquet source starts with (one per engine stream on a 2-core host).
EARLY_PIECES = 2
#: Read buffers a local job's source keeps for reuse per tensor column: the reads queued, in the
#: engine and being written at once (each is freed when its last batch has run; 5 were in use
#: at most in a 2-stream job of 8 MiB reads).
READ_SLOTS = 8
#: Scratch bytes before and after each read's values, for pages decompressed straight into the
#: read buffer: the levels in front of a page's values (~4% of a page of the benchmark's
#: tensors) and the rest of a page that runs past the read's last row (pages are ~1 MiB).
#: A page that does not fit is decompressed into a buffer of its own and copied, as before.
HEAD_BYTES, TAIL_BYTES = 1 << 17, 1 << 21


class ParquetSource(Source):
    """Parquet files (a file, or every ``*.parquet`` under a folder, sorted by path).

    ``fast=False`` reads every column with pyarrow (the page reader off: for comparisons)."""

    def __init__(
        self,
        path: Path,
        inputs: Sequence[TensorSpec],
        columns: Mapping[str, str] | None,
        keep: Sequence[str] | None,
        cast: bool,
        fast: bool = True,
    ) -> None:
        import pyarrow.parquet as pq

        self.root = path
        self.files = tuple(list_files(path, (".parquet", ".parq", ".pq"), "Parquet"))
        self.inputs = tuple(inputs)
        self.cast = cast
        self.fast = fast
        self._meta = []
        schema = None
        for f in self.files:
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
                raise DatasetError(
                    f"Parquet file {f}: cannot read it ({exc}); replace it or remove it from the "
                    "source folder"
                ) from None
            self._meta.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
            if schema is None:
                schema = meta.schema.to_arrow_schema()
        assert schema is not None
        self.schema = schema
        self.mapping = _mapping(inputs, columns, schema.names, f"Parquet source {path}")
        used = set(self.mapping.values())
        if keep is None:
            self.keep = [f.name for f in schema if f.name not in used and is_id_type(f.type)]
        else:
            self.keep = list(keep)
            for k in self.keep:
                if k not in schema.names:
                    raise DatasetError(
                        f"Parquet source {path} has no column {k!r} to keep{closest(k, schema.names)}"
                    )
        self.rows = sum(sum(m) for m in self._meta)
        self.fingerprint = file_fingerprint(self.files, path, {"columns": self.mapping})
        self.description = f"parquet:{path}"
        #: Row groups read by the page reader and by pyarrow (the page reader's refusals).
        self.groups_fast = self.groups_arrow = 0
        #: The page reader's read buffers, reused once the engine is done with them.
        self._buffers = BufferPool(READ_SLOTS)

    def pieces(self, start: int, size: int) -> Iterator[Piece]:
        import pyarrow.parquet as pq

        step = read_rows(size, self.inputs)
        # The first EARLY_PIECES pieces are one batch each: the engine starts on the first
        # while the reader goes on, and a second stream on the second, not after a whole read
        # of ``step`` rows (measured at load 5: the second stream started 2-28 ms after the
        # first). ``early[0]``: one-batch pieces still to come.
        early = [EARLY_PIECES]
        row = 0
        for f, groups in zip(self.files, self._meta):
            total = sum(groups)
            if row + total <= start:
                row += total
                continue
            try:
                # Memory-mapped (no copy out of the page cache), decoded on this thread: the
                # columns pyarrow's threads would decode in parallel are mostly one tensor
                # column, and the reader runs beside the engine, whose threads want the cores.
                pf = pq.ParquetFile(f, memory_map=True)
                found = _tensor_leaves(pf, list(self.mapping.values())) if self.fast else {}
                leaves = {i: found[c] for i, c in self.mapping.items() if c in found}
                data = _map(f) if leaves else None
                for g, n in enumerate(groups):
                    if row + n <= start:
                        row += n
                        continue
                    skip = max(start - row, 0)
                    got = skip
                    if data is not None:
                        try:
                            for piece in self._fast_group(
                                pf, data, leaves, g, n, skip, (size, step), f, row, early
                            ):
                                yield piece
                                got += piece.rows
                            self.groups_fast += 1
                        except pages.Unsupported:
                            pass  # the rest of the group (from ``got``) through pyarrow
                    if got < n:
                        self.groups_arrow += 1
                        yield from self._arrow_group(pf, g, got, step, f, row)
                    row += n
            except DatasetError:
                raise
            except Exception as exc:
                raise DatasetError(
                    f"Parquet file {f}: cannot read it ({exc}); replace it or remove it"
                ) from None

    def close(self) -> None:
        """Drop the kept read buffers (a held source object keeps no memory of its job)."""
        self._buffers = BufferPool(READ_SLOTS)

    def _needed(self) -> list[str]:
        return list(dict.fromkeys([*self.mapping.values(), *self.keep]))

    def _arrow_group(self, pf: Any, g: int, skip: int, step: int, f: Path, row: int) -> Iterator[Piece]:  # fmt: skip
        """Rows ``skip:`` of row group ``g`` read by pyarrow."""
        at = 0
        batches = pf.iter_batches(
            batch_size=step, row_groups=[g], columns=self._needed(), use_threads=False
        )
        for rb in batches:
            if at + rb.num_rows <= skip:
                at += rb.num_rows
                continue
            if at < skip:
                rb = rb.slice(skip - at)
                at = skip
            yield self._piece(rb, f, row + at)
            at += rb.num_rows

    def _piece(self, rb: Any, f: Path, row: int) -> Piece:
        feeds = {}
        for spec in self.inputs:
            col = self.mapping[spec.name]
            what = f"column {col!r} of {f} (rows from {row})"
            feeds[spec.name] = check_rows(spec, to_numpy(rb.column(col), what), what, self.cast)
        ids = {k: rb.column(k) for k in self.keep} if self.keep else _row_ids(row, rb.num_rows)
        return Piece(ids, feeds, rb.num_rows)

    def _fast_group(
        self, pf: Any, data: memoryview, leaves: dict[str, _Leaf], g: int, n: int, skip: int,
        steps: tuple[int, int], f: Path, row0: int, early: list[int],
    ) -> Iterator[Piece]:  # fmt: skip
        """Rows ``skip:`` of row group ``g``: tensor inputs by the page reader, ids by pyarrow;
        pieces of ``steps[0]`` rows while ``early[0]`` (counted down), then ``steps[1]``.

        Raises:
            pages.Unsupported: before yielding the piece it could not read.
        """
        meta = pf.metadata.row_group(g)
        readers = {}
        for name, leaf in leaves.items():
            chunk = meta.column(leaf.index)
            if chunk.num_values != n * leaf.size:
                raise pages.Unsupported("value count")  # nulls (or a writer we do not know)
            column = pages.Column(data, chunk, leaf.max_def, leaf.max_rep)
            readers[name] = _Values(column, skip * leaf.size)  # rows before the start: dropped
        others = [k for k in self._needed() if k not in {self.mapping[i] for i in leaves}]
        table = pf.read_row_group(g, columns=others, use_threads=False) if others else None
        cols = {k: _array(table.column(k)) for k in others} if table is not None else {}
        lo = skip
        while lo < n:
            rows = min(steps[0] if early[0] > 0 else steps[1], n - lo)
            early[0] -= 1
            feeds = {}
            for spec in self.inputs:
                col = self.mapping[spec.name]
                what = f"column {col!r} of {f} (rows from {row0 + lo})"
                if spec.name in readers:
                    leaf = leaves[spec.name]
                    count = rows * leaf.size
                    reader = readers[spec.name]
                    nbytes = HEAD_BYTES + count * reader.dtype.itemsize + TAIL_BYTES
                    raw = self._buffers.get(spec.name, nbytes, np.uint8)
                    a = reader.fill(raw, HEAD_BYTES, count).reshape(rows, *leaf.shape)
                else:
                    a = to_numpy(cols[col].slice(lo, rows), what)
                feeds[spec.name] = check_rows(spec, a, what, self.cast)
            if self.keep:
                ids = {k: cols[k].slice(lo, rows) for k in self.keep}
            else:
                ids = _row_ids(row0 + lo, rows)
            yield Piece(ids, feeds, rows)
            lo += rows


class _Leaf:
    """Where a tensor column's values are in the file, and each row's shape."""

    def __init__(self, index: int, max_def: int, max_rep: int, shape: tuple[int, ...]) -> None:
        self.index, self.max_def, self.max_rep, self.shape = index, max_def, max_rep, shape
        self.size = int(np.prod(shape, dtype=np.int64))


class _Values:
    """A column chunk's values from ``skip`` on, taken in runs of any length."""

    def __init__(self, column: pages.Column, skip: int = 0) -> None:
        self.pages = column.walk(skip)
        self.dtype = column.dtype
        self.left: np.ndarray = _NONE

    def take(self, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """The next ``count`` values, in ``out`` when given (a slice of a larger array: no
        second copy to join runs)."""
        out = np.empty(count, self.dtype) if out is None else out
        self.fill(out.view(np.uint8), 0, count)
        return out

    def fill(self, buf: np.ndarray, start: int, count: int, end: int | None = None) -> np.ndarray:
        """The next ``count`` values written into ``buf`` (bytes) from ``buf[start]``, returned
        as a view of them. ``buf[:start]`` and ``buf[start + count * itemsize:end]`` (``end``:
        all of ``buf``) are scratch: a page decompressed in place puts its levels in front of
        its values, and a page that runs past the last value ends in the scratch after it
        (kept as the next call's first values).

        Pages are planned front to back and written back to front: each page's levels land
        in bytes of earlier values, written after them."""
        size = self.dtype.itemsize
        end = len(buf) if end is None else end
        plan: list[tuple[int, np.ndarray | pages.Page]] = []  # (first value, what goes there)
        at = 0
        while at < count:
            if len(self.left):
                k = min(count - at, len(self.left))
                plan.append((at, self.left[:k]))
                self.left = self.left[k:] if k < len(self.left) else _NONE
                at += k
                continue
            page = next(self.pages, None)
            if page is None:
                raise pages.Unsupported("fewer values than rows")
            first, stop = start + at * size, start + (at + page.n) * size
            if page.levels >= 0 and first - page.levels >= 0 and stop <= end:
                plan.append((at, page))
                if at + page.n > count:  # the rest stays in the scratch after the last value
                    self.left = buf[start + count * size : stop].view(self.dtype)
                at = min(at + page.n, count)
            else:
                self.left = page.values()
        out = buf[start : start + count * size].view(self.dtype)
        for at, part in reversed(plan):
            if isinstance(part, pages.Page):
                part.into(buf, start + at * size)
            else:
                out[at : at + len(part)] = part
        return out


#: No values left (not a view of a read buffer, which would keep it from being reused).
_NONE = np.empty(0, np.uint8)


def _array(col: Any) -> Any:
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _map(f: Path) -> memoryview:
    import pyarrow as pa

    # pyarrow's map: its buffer keeps the mapping alive for as long as any view of it (the
    # arrays handed on are copies, so none outlives the read). Unsigned bytes: a pyarrow
    # buffer's view indexes as signed ones, which turn a Thrift field header of 0x80 or more
    # (a field id 8 or more past the last) negative, and each index costs more.
    return memoryview(pa.memory_map(str(f), "r").read_buffer()).cast("B")


def _leaf_count(t: Any) -> int:
    import pyarrow as pa

    if isinstance(t, pa.ExtensionType):
        return _leaf_count(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaf_count(t.key_type) + _leaf_count(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_count(t.value_type)
    return 1


def _fixed_shape(t: Any) -> tuple[tuple[int, ...], Any, int] | None:
    """A fixed-size list (nested) or fixed-shape tensor type: its row shape, value type and
    list depth (the Parquet leaf's maximum repetition level)."""
    import pyarrow as pa

    if isinstance(t, pa.FixedShapeTensorType):
        if list(t.permutation or range(len(t.shape))) != list(range(len(t.shape))):
            return None  # stored in another axis order: pyarrow's conversion handles it
        return tuple(t.shape), t.value_type, 1
    dims = []
    while pa.types.is_fixed_size_list(t):
        dims.append(t.list_size)
        t = t.value_type
    return (tuple(dims), t, len(dims)) if dims else None


def _tensor_leaves(pf: Any, columns: Sequence[str]) -> dict[str, _Leaf]:
    """The columns the page reader can read, with where their values are in the file."""
    import pyarrow as pa

    schema = pf.schema_arrow
    pschema = pf.metadata.schema
    starts, at = {}, 0
    for field in schema:
        starts[field.name] = at
        at += _leaf_count(field.type)
    if at != len(pschema):
        return {}  # the Arrow schema does not map onto the Parquet leaves as expected
    out = {}
    for col in dict.fromkeys(columns):
        fixed = _fixed_shape(schema.field(col).type)
        if fixed is None:
            continue
        shape, value_type, depth = fixed
        leaf = pschema.column(starts[col])
        dtype = pages.PHYSICAL.get(leaf.physical_type)
        if not pa.types.is_primitive(value_type) or dtype is None:
            continue
        if np.dtype(value_type.to_pandas_dtype()) != np.dtype(dtype):
            continue  # e.g. int8 values stored as INT32: pyarrow converts them
        if leaf.max_repetition_level != depth or not leaf.path.startswith(col):
            continue
        out[col] = _Leaf(starts[col], leaf.max_definition_level, leaf.max_repetition_level, shape)
    return out


def read_group(
    path: str | Path, group: int, columns: Sequence[str] | None = None, skip: int = 0
) -> Any:
    """Rows ``skip:`` of one row group as a pyarrow Table, tensor columns by the page reader
    (rebuilt as their own Arrow type around the values, without a copy)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path, memory_map=True)
    n = pf.metadata.row_group(group).num_rows
    names = list(pf.schema_arrow.names if columns is None else columns)
    return read_groups([(str(path), group, skip, n - skip)], names)


def read_groups(pieces: Sequence[tuple[str, int, int, int]], columns: Sequence[str]) -> Any:
    """Rows of several row groups — ``(file, group, first row, rows)`` each, in order — as one
    pyarrow Table whose tensor columns are each ONE buffer: the page reader writes every
    piece's values straight into it (joining per-group tables would leave chunks that the
    engine's input needs joined: a second copy of every input). A piece it cannot read that
    way sends the whole column to pyarrow, piece by piece; for Ray's read tasks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {f: pq.ParquetFile(f, memory_map=True) for f, *_ in pieces}
    total = sum(take for *_, take in pieces)
    leaves = {f: _tensor_leaves(pf, columns) for f, pf in files.items()}
    maps = {f: _map(Path(f)) for f in files if leaves[f]}
    fast: dict[str, Any] = {}
    first = files[pieces[0][0]]
    for col in columns:
        leaf = leaves[pieces[0][0]].get(col)
        if leaf is None or any(
            (got := leaves[f].get(col)) is None
            or (got.shape, got.index) != (leaf.shape, leaf.index)
            for f in files
        ):
            continue
        dtype = np.dtype(pages.PHYSICAL[first.metadata.schema.column(leaf.index).physical_type])
        head = HEAD_BYTES // dtype.itemsize
        flat = spare_buffer(col, head + total * leaf.size, dtype)
        raw = flat.view(np.uint8)
        flat = flat[head:]
        ends = np.cumsum([take * leaf.size for *_, take in pieces])
        try:
            # The last piece first: the bytes before a piece's values (earlier pieces', not
            # written yet) are scratch for the levels of pages decompressed in place.
            for (f, g, skip, take), stop in zip(reversed(pieces), reversed(ends.tolist())):
                chunk = files[f].metadata.row_group(g).column(leaf.index)
                if chunk.num_values != files[f].metadata.row_group(g).num_rows * leaf.size:
                    raise pages.Unsupported("value count")
                column = pages.Column(maps[f], chunk, leaf.max_def, leaf.max_rep)
                n = take * leaf.size
                start = (head + stop - n) * dtype.itemsize
                _Values(column, skip * leaf.size).fill(raw, start, n, start + n * dtype.itemsize)
        except pages.Unsupported:
            continue
        fast[col] = _as_type(flat, first.schema_arrow.field(col).type, leaf.size)
    rest = [c for c in columns if c not in fast]
    if rest:
        table = pa.concat_tables(
            [
                files[f].read_row_group(g, columns=rest, use_threads=False).slice(skip, take)
                for f, g, skip, take in pieces
            ]
        )
        fast.update({c: table.column(c) for c in rest})
    return pa.table({c: fast[c] for c in columns})


#: Buffers smaller than this are allocated afresh each read (reusing them saves nothing).
SPARE_MIN_BYTES = 16 << 20
_spares: dict[str, np.ndarray] = {}
_spares_lock = threading.Lock()


def spare_buffer(key: str, count: int, dtype: Any) -> np.ndarray:
    """``count`` values of ``dtype`` for a read (uninitialised), in the buffer the last read of
    ``key`` used when nothing refers to it any more, else in a new one that the next read
    may reuse.

    Why: a Ray read task's block is one buffer of up to 128 MiB per tensor column, and a new
    buffer that size is new memory, which the kernel zeroes page by page as the reader first
    writes it: 18% of the worker processes' samples (``clear_page_erms`` under the copy into
    it), and --ray's system CPU 1.3-2.0 s per 100k rows of the demo CNN against the local
    run's 0.4. The process reuses the block it has finished with instead. Safe by
    construction: a block still alive anywhere (a view, an Arrow array around it) holds a
    reference to the buffer, and a buffer with any reference but this cache's is never
    handed out again."""
    dtype = np.dtype(dtype)
    if count * dtype.itemsize < SPARE_MIN_BYTES:
        return np.empty(count, dtype)
    with _spares_lock:
        old = _spares.get(key)
        # 3: the cache's reference, ``old`` and getrefcount's argument; any more is a reader.
        if (
            old is not None
            and old.dtype == dtype
            and old.size >= count
            and sys.getrefcount(old) == 3
        ):
            return old[:count]
        new = _spares[key] = np.empty(count, dtype)
        return new[:count]


class BufferPool:
    """Buffers for reads, each reused once nothing but the pool refers to it.

    Why: a new read buffer of a few MiB is new memory, which the kernel zeroes page by page
    as the reader first writes it (see :func:`spare_buffer`); a local job's reads are handed
    to the engine and dropped batch by batch, so a few buffers go round. Safe by construction:
    a buffer any batch still views is never handed out again."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, count: int, dtype: Any) -> np.ndarray:
        """``count`` values of ``dtype``, uninitialised."""
        dtype = np.dtype(dtype)
        with self._lock:
            kept = self._free.setdefault(key, [])
            for buf in kept:
                # 3: the list's reference, ``buf`` and getrefcount's argument; more: in use.
                if buf.dtype == dtype and buf.size >= count and sys.getrefcount(buf) == 3:
                    return buf[:count]
            new = np.empty(count, dtype)
            if len(kept) < self.slots:
                kept.append(new)
            return new


def _as_type(flat: np.ndarray, t: Any, size: int) -> Any:
    """Flat values as a column of Arrow type ``t`` (fixed-size lists or fixed-shape tensor),
    field names and all, around the same buffer."""
    import pyarrow as pa

    if isinstance(t, pa.FixedShapeTensorType):
        return pa.ExtensionArray.from_storage(t, _as_type(flat, t.storage_type, size))
    if not pa.types.is_fixed_size_list(t):
        return pa.array(flat, type=t)
    inner = _as_type(flat, t.value_type, size // t.list_size)
    return pa.FixedSizeListArray.from_arrays(inner, type=t)
