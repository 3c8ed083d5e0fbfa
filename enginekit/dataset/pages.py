"""A fast reader for the tensor columns of Parquet files: values straight out of the data pages.

Arrow writes a fixed-size list column (nested or not, and the fixed-shape tensor extension type,
whose storage is one) as a Parquet LIST with a repetition and a definition level per value.
pyarrow's reader rebuilds the list structure from those levels value by value: for a 3x32x32
float tensor that is most of the cost of reading it (0.48 CPU-s per 20k rows, against 0.13 for
the same bytes as fixed-size binary). When no value is null, the structure carries no
information the Arrow schema does not already give (every list has its fixed size), so this
module skips the levels — after checking, page by page, that every definition level says
"present" — and takes the values as they are stored: decompressed, then a view (PLAIN) or a
dictionary lookup (RLE_DICTIONARY).

Anything else — a null, an encoding or codec not handled here, a page type it does not know, a
value count that does not fit — raises :class:`Unsupported` before any of that page's values
are used, and the caller reads those rows with pyarrow instead (same result, slower).

With ``cramjam`` installed, a v1 PLAIN page can also be decompressed straight into the caller's
buffer (:meth:`Page.into`): one memory pass instead of two (pyarrow decompresses only into a
new buffer, which then had to be copied into the batch).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

#: Parquet physical type -> numpy dtype of the values this reader takes as stored.
PHYSICAL = {"FLOAT": "<f4", "DOUBLE": "<f8", "INT32": "<i4", "INT64": "<i8"}
#: Parquet codec name -> pyarrow codec name.
CODECS = {
    "SNAPPY": "snappy",
    "ZSTD": "zstd",
    "GZIP": "gzip",
    "BROTLI": "brotli",
    "LZ4_RAW": "lz4_raw",
}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3

#: (compressed page, output buffer of its exact uncompressed size) -> bytes written.
Into = Callable[[Any, Any], int]


def _copy(page: memoryview, out: np.ndarray) -> int:
    out[:] = np.frombuffer(page, np.uint8, len(out))
    return len(out)


def _decompressors() -> tuple[dict[str | None, Into], tuple[type[BaseException], ...]]:
    """Codec (pyarrow's name; None: uncompressed) -> a function that decompresses a page into a
    caller's buffer of exactly its size and returns the bytes written, and the errors those
    raise on bytes that are not that codec's; none without ``cramjam``."""
    try:
        import cramjam
    except ImportError:
        return {}, ()
    into: dict[str | None, Into] = {
        None: _copy,
        "snappy": cramjam.snappy.decompress_raw_into,
        "zstd": cramjam.zstd.decompress_into,
        "gzip": cramjam.gzip.decompress_into,
        "brotli": cramjam.brotli.decompress_into,
        # A Parquet LZ4_RAW page is a bare block: its size is the buffer's, not a prefix.
        "lz4_raw": lambda page, out: cramjam.lz4.decompress_block_into(
            page, out, output_len=len(out)
        ),
    }
    return into, (cramjam.DecompressionError, ValueError)


#: Decompress-into functions by codec, and the errors they raise.
INTO, INTO_ERRORS = _decompressors()


class Unsupported(Exception):
    """This reader cannot take these values as stored: read them with pyarrow instead."""


# -- Thrift compact protocol (page headers) -------------------------------------------------------


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _zigzag(buf: memoryview, pos: int) -> tuple[int, int]:
    v, pos = _varint(buf, pos)
    return (v >> 1) ^ -(v & 1), pos


def _value(buf: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    if kind in (1, 2):  # bool inside a struct: the type is the value
        return kind == 1, pos
    if kind == 3:
        return buf[pos], pos + 1
    if kind in (4, 5, 6):
        return _zigzag(buf, pos)
    if kind == 7:
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if kind == 8:
        n, pos = _varint(buf, pos)
        return bytes(buf[pos : pos + n]), pos + n
    if kind in (9, 10):
        head = buf[pos]
        pos += 1
        n, elem = head >> 4, head & 0x0F
        if n == 15:
            n, pos = _varint(buf, pos)
        items = []
        for _ in range(n):
            if elem in (1, 2):  # bools in a list are one byte each
                item, pos = buf[pos] == 1, pos + 1
            else:
                item, pos = _value(buf, pos, elem)
            items.append(item)
        return items, pos
    if kind == 11:
        n, pos = _varint(buf, pos)
        if not n:
            return {}, pos
        types = buf[pos]
        pos += 1
        out = {}
        for _ in range(n):
            k, pos = _value(buf, pos, types >> 4)
            out[k], pos = _value(buf, pos, types & 0x0F)
        return out, pos
    if kind == 12:
        return struct_at(buf, pos)
    raise Unsupported(f"thrift type {kind}")


def struct_at(buf: memoryview, pos: int) -> tuple[dict[int, Any], int]:
    """A Thrift compact struct at ``pos``: field id -> value (structs as dicts), and the end."""
    fields: dict[int, Any] = {}
    last = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        delta, kind = head >> 4, head & 0x0F
        if delta:
            fid = last + delta
        else:
            fid, pos = _zigzag(buf, pos)
        fields[fid], pos = _value(buf, pos, kind)
        last = fid


# -- RLE / bit-packed hybrid ----------------------------------------------------------------------


def _unpack(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    """``count`` little-endian ``width``-bit integers packed in ``data`` (``width`` <= 32), as
    uint32."""
    if width == 0:
        return np.zeros(count, np.uint32)
    if width > 32:
        raise Unsupported(f"bit width {width}")
    if width in (8, 16, 32) and len(data) >= count * width // 8:  # whole bytes: a view
        dtype = {8: "<u1", 16: "<u2", 32: "<u4"}[width]
        return np.frombuffer(data, dtype, count).astype(np.uint32)
    padded = _padded(-(-count // 8) * width)
    got = np.frombuffer(data, np.uint8, min(len(data), len(padded) - 8))
    padded[: len(got)] = got
    padded[len(got) :] = 0
    return _unpack_padded(padded, width, count)


def _padded(size: int) -> np.ndarray:
    """An uninitialised byte array of ``size`` bytes and 8 more (the last word read of
    :func:`_unpack_padded` may reach past the packed bytes)."""
    return np.empty(size + 8, np.uint8)


def _unpack_padded(padded: np.ndarray, width: int, count: int) -> np.ndarray:
    """:func:`_unpack` of bytes already in one array with 8 bytes to spare after the packed
    ones (zero from the first byte past them: a run cut short reads as zeros)."""
    # Eight values fill exactly ``width`` bytes, so value j of every group starts at the same
    # byte and bit: read each as one little-endian word through a strided view of the bytes
    # (no per-value gathers, no per-bit arrays: a page holds ~10^5 dictionary indices).
    groups = -(-count // 8)
    word = np.dtype("<u4") if width <= 25 else np.dtype("<u8")  # 7 bits of shift + width fit
    out = np.empty((groups, 8), np.uint32)
    tmp = np.empty(groups, word)
    mask = word.type((1 << width) - 1)
    for j in range(8):
        first, shift = divmod(j * width, 8)
        view = np.ndarray((groups,), word, padded, offset=first, strides=(width,))
        np.right_shift(view, word.type(shift), out=tmp)
        np.bitwise_and(tmp, mask, out=out[:, j], casting="unsafe")
    return out.reshape(-1)[:count]


#: The header of a bit-packed run of 63 groups (504 values): the longest Arrow writes.
_LONGEST = 63 << 1 | 1


def _longest_runs(buf: memoryview, at: int, end: int, width: int, left: int) -> int:
    """How many 63-group bit-packed runs follow one another from ``buf[at]`` (a header), whole
    before ``end`` and all needed for ``left`` more values."""
    stride = 1 + 63 * width
    most = min(-(-left // 504), (end - at) // stride)
    if most < 2:
        return 0  # one run: the plain loop is as quick
    heads = np.frombuffer(buf, np.uint8, most * stride, at)[::stride]
    other = np.flatnonzero(heads != _LONGEST)
    return int(other[0]) if len(other) else most


def hybrid(buf: memoryview, pos: int, end: int, width: int, count: int) -> np.ndarray:
    """Decode ``count`` values of the RLE/bit-packed hybrid encoding in ``buf[pos:end]`` (as
    uint32).

    One pass over the run headers only (a page holds ~500 runs of up to 504 values); then the
    bit-packed runs' bytes are joined and unpacked at once, and the RLE runs repeated at once.
    """
    nbytes = (width + 7) // 8
    packed: list[np.ndarray] = []  # the bytes of each bit-packed run, in order
    lengths: list[int] = []  # values in each run, in order
    is_packed: list[bool] = []
    rle: list[int] = []  # each RLE run's value, in order
    got = 0
    while got < count:
        if pos >= end:
            raise Unsupported("levels end early")
        head, pos = _varint(buf, pos)
        if (
            head == _LONGEST
            and width
            and (k := _longest_runs(buf, pos - 1, end, width, count - got))
        ):
            # Arrow writes long stretches of distinct values as 63-group runs back to back:
            # all of those that follow are taken at once, their header bytes cut off by a view.
            stride = 1 + 63 * width
            rows = np.frombuffer(buf, np.uint8, k * stride, pos - 1).reshape(k, stride)
            packed.append(rows[:, 1:])  # copied once, into the bytes to unpack
            n = k * 504
            pos += k * stride - 1
        elif head & 1:
            size = (head >> 1) * width
            if pos + size > end:
                size = end - pos  # a final run may be cut short after its last value
            packed.append(np.frombuffer(buf, np.uint8, size, pos))
            n = (head >> 1) * 8
            pos += size
        else:
            rle.append(int.from_bytes(buf[pos : pos + nbytes], "little"))
            n = head >> 1
            pos += nbytes
        is_packed.append(bool(head & 1))
        lengths.append(n)
        got += n
    if not rle:
        return _unpack_runs(packed, width, got)[:count]
    if not packed:
        return np.repeat(np.array(rle, np.uint32), lengths)[:count]
    flags = np.array(is_packed)
    sizes = np.array(lengths, np.int64)
    out = np.empty(got, np.uint32)
    where = np.repeat(flags, sizes)
    out[where] = _unpack_runs(packed, width, int(sizes[flags].sum()))
    out[~where] = np.repeat(np.array(rle, np.uint32), sizes[~flags])
    return out[:count]


def _unpack_runs(runs: list[np.ndarray], width: int, count: int) -> np.ndarray:
    """The ``count`` values of bit-packed runs, in order: their bytes copied once, into one
    array with room to read whole words (not joined, then copied again)."""
    if not width:
        return np.zeros(count, np.uint32)
    if width > 32:
        raise Unsupported(f"bit width {width}")
    size = sum(r.size for r in runs)
    padded = _padded(max(size, -(-count // 8) * width))
    at = 0
    for r in runs:
        padded[at : at + r.size].reshape(r.shape)[...] = r
        at += r.size
    padded[at:] = 0
    if width in (8, 16, 32):
        dtype = {8: "<u1", 16: "<u2", 32: "<u4"}[width]
        return padded[: count * width // 8].view(dtype).astype(np.uint32)
    return _unpack_padded(padded, width, count)


def all_equal(buf: memoryview, pos: int, end: int, width: int, count: int, value: int) -> bool:
    """Whether all ``count`` hybrid-encoded values in ``buf[pos:end]`` are ``value``; RLE runs
    (how Arrow writes levels that never change) are checked without decoding."""
    nbytes = (width + 7) // 8
    got = 0
    while got < count:
        if pos >= end:
            return False
        head, pos = _varint(buf, pos)
        if head & 1:
            n = (head >> 1) * 8
            size = (head >> 1) * width
            vals = _unpack(buf[pos : pos + size], width, n)[: count - got]
            if (vals != value).any():
                return False
            pos += size
        else:
            n = head >> 1
            if int.from_bytes(buf[pos : pos + nbytes], "little") != value:
                return False
            pos += nbytes
        got += n
    return True


def _width(level: int) -> int:
    return int(level).bit_length()


# -- column chunks --------------------------------------------------------------------------------


class Column:
    """The values of one column chunk, page by page, as numpy arrays.

    Args:
        data: the whole file (a memory map).
        meta: pyarrow's ``ColumnChunkMetaData`` of the chunk.
        max_def, max_rep: the leaf's maximum definition and repetition levels.
    """

    def __init__(self, data: memoryview, meta: Any, max_def: int, max_rep: int) -> None:
        dtype = PHYSICAL.get(meta.physical_type)
        codec = meta.compression
        if dtype is None:
            raise Unsupported(f"physical type {meta.physical_type}")
        if codec != "UNCOMPRESSED" and codec not in CODECS:
            raise Unsupported(f"codec {codec}")
        self.data = data
        self.dtype = np.dtype(dtype)
        self.codec = None if codec == "UNCOMPRESSED" else CODECS[codec]
        self.max_def, self.max_rep = max_def, max_rep
        start = meta.data_page_offset
        if meta.has_dictionary_page and meta.dictionary_page_offset:
            start = min(start, meta.dictionary_page_offset)
        self.pos, self.end = start, start + meta.total_compressed_size
        self.values = meta.num_values  # level entries in the chunk: all values when none is null
        self.dictionary: np.ndarray | None = None

    def pages(self, skip: int = 0) -> Iterator[np.ndarray]:
        """Each data page's values, in order (checked: no nulls, ``values`` in all), less the
        first ``skip``: whole pages of those are passed over undecompressed (a resumed job's
        rows before its start), the rest cut from the first page yielded."""
        for page in self.walk(skip):
            yield page.values()

    def walk(self, skip: int = 0) -> Iterator[Page]:
        """:meth:`pages`, each page not yet decompressed (the dictionary page is, on the way)."""
        seen = 0
        while self.pos < self.end and seen < self.values:
            header, body = struct_at(self.data, self.pos)
            size = header[3]
            page = self.data[body : body + size]
            self.pos = body + size
            kind = header[1]
            if kind == _DICTIONARY_PAGE:
                dph = header[7]
                if dph.get(2, _PLAIN) not in (_PLAIN, _PLAIN_DICTIONARY):
                    raise Unsupported("dictionary encoding")
                if self.dictionary is not None:
                    raise Unsupported("a second dictionary page")  # pages decoded later use one
                raw = self._decompress(page, header[2])
                self.dictionary = np.frombuffer(raw, self.dtype, dph[1])
                continue
            if kind not in (_DATA_PAGE, _DATA_PAGE_V2):
                continue  # index pages: nothing to read
            count = header[5 if kind == _DATA_PAGE else 8][1]  # level entries: rows x size
            if seen + count <= skip:
                seen += count  # before the start: its values (and nulls) are never used
                continue
            cut = max(skip - seen, 0)
            seen += count
            yield Page(self, header, page, count - cut, cut)
        if seen != self.values:
            raise Unsupported(f"{seen} values in the pages, {self.values} in the metadata")

    def _decompress(self, page: memoryview, size: int) -> memoryview:
        if self.codec is None:
            return page
        import pyarrow as pa

        return memoryview(pa.decompress(page, size, codec=self.codec)).cast("B")

    def _page_v1(self, h: dict[int, Any], raw: memoryview) -> np.ndarray:
        n, encoding = h[1], h[2]
        pos = 0
        levels = ((self.max_rep, h.get(4, _RLE), False), (self.max_def, h.get(3, _RLE), True))
        for level, kind, definition in levels:
            if not level:
                continue
            if kind != _RLE:
                raise Unsupported("levels not RLE")
            (length,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            if definition and not all_equal(raw, pos, pos + length, _width(level), n, level):
                raise Unsupported("null values")
            pos += length
        return self._values(raw[pos:], encoding, n)

    def _page_v2(self, h: dict[int, Any], page: memoryview, size: int) -> np.ndarray:
        n, nulls, encoding = h[1], h[2], h[4]
        def_len, rep_len = h[5], h[6]
        if nulls:
            raise Unsupported("null values")
        levels = rep_len + def_len
        if self.max_def and not all_equal(
            page, rep_len, levels, _width(self.max_def), n, self.max_def
        ):
            raise Unsupported("null values")
        body = page[levels:]
        if h.get(7, True):
            body = self._decompress(body, size - levels)
        return self._values(body, encoding, n)

    def _values(self, raw: memoryview, encoding: int, n: int) -> np.ndarray:
        if encoding == _PLAIN:
            if len(raw) < n * self.dtype.itemsize:
                raise Unsupported("short page")
            return np.frombuffer(raw, self.dtype, n)
        if encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY) and self.dictionary is not None:
            idx = hybrid(raw, 1, len(raw), raw[0], n)
            try:  # one gather; its bounds check is the only one
                return self.dictionary.take(idx)
            except IndexError:
                raise Unsupported("dictionary index out of range") from None
        raise Unsupported(f"encoding {encoding}")


class Page:
    """One data page of a column chunk, not yet decompressed: its ``n`` values (after the first
    ``cut``) go into a new array (:meth:`values`) or straight into a caller's buffer
    (:meth:`into`)."""

    __slots__ = ("body", "column", "cut", "header", "levels", "n")

    def __init__(self, column: Column, header: dict[int, Any], body: memoryview, n: int, cut: int) -> None:  # fmt: skip
        self.column, self.header, self.body, self.n, self.cut = column, header, body, n, cut
        #: Bytes in front of the values once decompressed (the levels of a v1 page), when the
        #: page can be decompressed straight into a buffer; else -1.
        self.levels = -1
        v1 = header[1] == _DATA_PAGE
        if not cut and v1 and header[5][2] == _PLAIN and column.codec in INTO:
            self.levels = max(header[2] - n * column.dtype.itemsize, -1)

    def values(self) -> np.ndarray:
        """The values, decompressed into a new buffer (any page :class:`Column` reads)."""
        column, h = self.column, self.header
        if h[1] == _DATA_PAGE:
            got = column._page_v1(h[5], column._decompress(self.body, h[2]))
        else:
            got = column._page_v2(h[8], self.body, h[2])
        return got[self.cut :]

    def into(self, buf: np.ndarray, at: int) -> None:
        """Decompress the page into ``buf`` (bytes) so that its values start at ``buf[at]``; its
        levels land in the :attr:`levels` bytes before, and are checked there (a page that
        does not decompress this way is read by :meth:`values` instead, and copied).

        Raises:
            Unsupported: nulls, or levels of another length than the page's size implies.
        """
        column, size = self.column, self.header[2]
        nbytes = self.n * column.dtype.itemsize
        region = buf[at - self.levels : at + nbytes]
        try:
            got = INTO[column.codec](self.body, region)
        except INTO_ERRORS:
            got = -1
        if got != size:  # not what pyarrow reads: let its decompressor decide (and raise)
            region[self.levels :] = self.values().view(np.uint8)
            return
        values = column._page_v1(self.header[5], region.data)
        if len(values) != self.n or values.ctypes.data != buf.ctypes.data + at:
            raise Unsupported("levels of another length")
