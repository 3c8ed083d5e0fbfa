"""The Parquet page reader: the same rows as pyarrow's reader for every layout it takes, and
pyarrow's rows (or pyarrow's errors) for what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
import pyarrow as pa
import pyarrow.parquet as pq

from enginekit.dataset import pages
from enginekit.dataset.columns import from_numpy
from enginekit.dataset.parquet import ParquetSource
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError

SPEC = [TensorSpec("x", "float32", ("batch", 2, 3, 4))]


def _rows(n: int, dtype: str = "float32") -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((n, 2, 3, 4)) * 100).astype(dtype)


def _read(path, start=0, size=5, fast=True, spec=SPEC, keep=None):
    src = ParquetSource(path, spec, None, keep, False, fast=fast)
    got = list(src.pieces(start, size))
    x = np.concatenate([p.inputs["x"] for p in got])
    ids = {k: pa.concat_arrays([pa.array(p.ids[k]) for p in got]).to_pylist() for k in got[0].ids}
    return x, ids, src


def _same_as_pyarrow(path, start=0, spec=SPEC, groups_fast=None):
    x, ids, src = _read(path, start, spec=spec)
    ref_x, ref_ids, _ = _read(path, start, fast=False, spec=spec)
    np.testing.assert_array_equal(x, ref_x)
    assert ids == ref_ids
    if groups_fast is not None:
        assert (src.groups_fast, src.groups_arrow) == groups_fast
    return x


@pytest.mark.parametrize(
    "layout, options",
    [
        ("list", {}),  # nested fixed-size lists, dictionary pages then PLAIN (pyarrow's default)
        ("tensor", {"compression": "zstd"}),
        ("flat", {"compression": "none", "use_dictionary": False}),
        ("list", {"data_page_version": "2.0", "data_page_size": 256, "write_batch_size": 64}),
        (
            "tensor",
            {"dictionary_pagesize_limit": 64, "data_page_size": 128, "write_batch_size": 32},
        ),
    ],
)
def test_page_reader_matches_pyarrow(tmp_path, layout, options):
    x = _rows(37)
    col = (
        pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 24)
        if layout == "flat"
        else from_numpy(x, layout)
    )
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": np.arange(37), "x": col}), path, row_group_size=10, **options)
    spec = [TensorSpec("x", "float32", ("batch", 24))] if layout == "flat" else SPEC
    got = _same_as_pyarrow(path, spec=spec, groups_fast=(4, 0))
    np.testing.assert_array_equal(got.reshape(x.shape), x)
    # From a row inside the second row group: the rows before it are dropped.
    got = _same_as_pyarrow(path, start=13, spec=spec, groups_fast=(3, 0))
    np.testing.assert_array_equal(got.reshape(-1, *x.shape[1:]), x[13:])


def test_integer_tensors_and_values_pyarrow_must_convert(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"x": from_numpy(_rows(9, "int64"), "list"), "y": from_numpy(_rows(9, "int8"), "list")}),
        path, row_group_size=4,
    )  # fmt: skip
    spec = [TensorSpec("x", "int64", ("batch", 2, 3, 4))]
    _same_as_pyarrow(path, spec=spec, groups_fast=(3, 0))
    # int8 values are stored as INT32: pyarrow converts them back.
    spec8 = [TensorSpec("x", "int8", ("batch", 2, 3, 4))]
    src = ParquetSource(path, spec8, {"x": "y"}, None, False)
    np.testing.assert_array_equal(
        np.concatenate([p.inputs["x"] for p in src.pieces(0, 4)]), _rows(9, "int8")
    )
    assert (src.groups_fast, src.groups_arrow) == (0, 3)


def test_nulls_fall_back_to_pyarrow_and_its_error(tmp_path):
    x = _rows(6)
    values = pa.array(x.reshape(-1), mask=np.arange(x.size) == 30)  # one null value in row 1
    col = pa.FixedSizeListArray.from_arrays(values, 24)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": col}), path)
    spec = [TensorSpec("x", "float32", ("batch", 24))]
    with pytest.raises(DatasetError, match="null"):
        _read(path, spec=spec)


def test_a_page_refused_mid_group_continues_with_pyarrow(tmp_path, monkeypatch):
    x = _rows(40)
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"k": [f"r{i}" for i in range(40)], "x": from_numpy(x, "list")}), path,
        data_page_size=200, write_batch_size=48, use_dictionary=False,
    )  # fmt: skip
    real = pages.Column._values
    calls = []

    def refuse_third(self, raw, encoding, n):
        calls.append(n)
        if len(calls) == 3:
            raise pages.Unsupported("test")
        return real(self, raw, encoding, n)

    monkeypatch.setattr(pages.Column, "_values", refuse_third)
    got, ids, src = _read(path, size=4)
    np.testing.assert_array_equal(got, x)
    assert ids["k"] == [f"r{i}" for i in range(40)]
    assert (src.groups_fast, src.groups_arrow) == (0, 1)


@pytest.mark.parametrize("width", [1, 3, 8, 13, 18, 25, 26, 32])
def test_bit_unpacking_and_the_hybrid_encoding(width):
    rng = np.random.default_rng(width)
    v = rng.integers(0, 1 << width, 21, dtype=np.int64)
    bits = ((v[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    bits = np.concatenate([bits, np.zeros(3 * 8 * width - bits.size, np.uint8)])
    packed = np.packbits(bits, bitorder="little").tobytes()
    np.testing.assert_array_equal(pages._unpack(packed, width, 21), v)
    # RLE run of 5 x 1, then a bit-packed run of 3 groups (the 21 values, padded to 24).
    nbytes = (width + 7) // 8
    buf = bytes([5 << 1]) + (1).to_bytes(nbytes, "little") + bytes([3 << 1 | 1]) + packed
    got = pages.hybrid(memoryview(buf), 0, len(buf), width, 26)
    np.testing.assert_array_equal(got, np.concatenate([np.ones(5, np.int64), v]))
    assert pages.all_equal(memoryview(buf), 0, 1 + nbytes, width, 5, 1)
    assert not pages.all_equal(memoryview(buf), 0, len(buf), width, 26, 1)


@pytest.mark.parametrize("layout", ["list", "tensor"])
def test_read_group_gives_pyarrow_s_table(tmp_path, layout):
    from enginekit.dataset.parquet import read_group

    path = tmp_path / "d.parquet"
    table = pa.table({"k": [f"r{i}" for i in range(12)], "x": from_numpy(_rows(12), layout)})
    pq.write_table(table, path, row_group_size=5)
    got = read_group(path, 1, ["x", "k"], skip=2)
    assert got.equals(pq.ParquetFile(path).read_row_group(1, columns=["x", "k"]).slice(2))
    assert read_group(path, 2).equals(pq.ParquetFile(path).read_row_group(2))


@pytest.mark.parametrize("layout", ["list", "tensor"])
def test_read_groups_of_two_files_give_one_buffer_per_tensor_column(tmp_path, layout):
    # A Ray read task's rows: the engine takes the column as it is, no join (a second copy).
    from enginekit.dataset.parquet import read_groups

    x = _rows(20)
    for i, (lo, hi) in enumerate([(0, 12), (12, 20)]):
        table = pa.table({"k": [f"r{j}" for j in range(lo, hi)], "x": from_numpy(x[lo:hi], layout)})
        pq.write_table(table, tmp_path / f"{i}.parquet", row_group_size=5)
    files = [str(tmp_path / "0.parquet"), str(tmp_path / "1.parquet")]
    got = read_groups([(files[0], 1, 3, 2), (files[0], 2, 0, 2), (files[1], 0, 1, 4)], ["x", "k"])
    assert got.column("x").num_chunks == 1 and got.column("x").type == table.column("x").type
    ref = pa.concat_tables(
        [
            pq.ParquetFile(f).read_row_group(g, columns=["x", "k"]).slice(skip, take)
            for f, g, skip, take in [(files[0], 1, 3, 2), (files[0], 2, 0, 2), (files[1], 0, 1, 4)]
        ]
    )
    assert got.equals(ref) and got.column("k").to_pylist() == [
        f"r{j}" for j in [8, 9, 10, 11, 13, 14, 15, 16]
    ]


def test_required_lists_and_values_read_by_pages(tmp_path):
    # No nullable level at all: the definition levels count only the lists (max_def = max_rep).
    x = _rows(9)
    t = pa.list_(pa.field("v", pa.float32(), nullable=False), 24)
    col = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), type=t)
    path = tmp_path / "d.parquet"
    schema = pa.schema([pa.field("x", t, nullable=False)])
    pq.write_table(pa.table({"x": col}, schema=schema), path, row_group_size=4)
    leaf = pq.ParquetFile(path).metadata.schema.column(0)
    assert leaf.max_definition_level == leaf.max_repetition_level == 1
    spec = [TensorSpec("x", "float32", ("batch", 24))]
    got = _same_as_pyarrow(path, spec=spec, groups_fast=(3, 0))
    np.testing.assert_array_equal(got, x.reshape(9, 24))


def _packed(values: np.ndarray, width: int) -> bytes:
    """``values`` bit-packed as Parquet does: little-endian, whole groups of 8 (zero-padded)."""
    padded = np.concatenate([values, np.zeros(-len(values) % 8, values.dtype)]).astype(np.uint64)
    bits = ((padded[:, None] >> np.arange(width, dtype=np.uint64)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


@pytest.mark.parametrize("width", range(1, 33))
def test_hybrid_runs_of_every_bit_width(width):
    # RLE, bit-packed, RLE, then a bit-packed run whose last group is partly past ``count``.
    rng = np.random.default_rng(width)
    top = 1 << width
    a, b = rng.integers(0, top, 16, dtype=np.uint64), rng.integers(0, top, 13, dtype=np.uint64)
    r1, r2 = int(rng.integers(0, top)), top - 1
    nbytes = (width + 7) // 8
    buf = b"".join(
        [
            bytes([3 << 1]), r1.to_bytes(nbytes, "little"),
            bytes([2 << 1 | 1]), _packed(a, width),
            bytes([0x80 | 4, 2]), r2.to_bytes(nbytes, "little"),  # two header bytes: 130 << 1 = 260
            bytes([2 << 1 | 1]), _packed(b, width),
        ]
    )  # fmt: skip
    want = np.concatenate([np.full(3, r1), a, np.full(130, r2), b]).astype(np.uint64)
    got = pages.hybrid(memoryview(b"\x07" + buf), 1, len(buf) + 1, width, len(want))
    np.testing.assert_array_equal(got.astype(np.uint64), want)
    # Bit-packed runs only (how dictionary indices are written), the last one cut at its end.
    only = bytes([2 << 1 | 1]) + _packed(a, width) + bytes([2 << 1 | 1]) + _packed(b, width)
    cut = len(only) - 2 * width + (13 * width + 7) // 8  # no bytes past b's 13th value
    got = pages.hybrid(memoryview(only), 0, cut, width, 29)
    np.testing.assert_array_equal(got.astype(np.uint64), np.concatenate([a, b]))
    # RLE runs only.
    rle = (
        bytes([3 << 1])
        + r1.to_bytes(nbytes, "little")
        + bytes([5 << 1])
        + r2.to_bytes(nbytes, "little")
    )
    got = pages.hybrid(memoryview(rle), 0, len(rle), width, 7)
    np.testing.assert_array_equal(got, [r1] * 3 + [r2] * 4)


def test_hybrid_bit_width_zero_and_short_input():
    # Width 0: RLE values have no bytes, bit-packed groups no bytes; every value is 0.
    buf = memoryview(bytes([4 << 1, 1 << 1 | 1, 2 << 1]))
    np.testing.assert_array_equal(pages.hybrid(buf, 0, len(buf), 0, 13), np.zeros(13))
    with pytest.raises(pages.Unsupported, match="end early"):
        pages.hybrid(buf, 0, len(buf), 0, 15)


def test_dictionary_of_one_value_and_indices_out_of_range(tmp_path):
    # One distinct value: a dictionary of one entry (its indices: one RLE run, pyarrow
    # writes them 1 bit wide).
    x = np.full((10, 2, 3, 4), 2.5, np.float32)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": from_numpy(x, "list")}), path, row_group_size=4)
    np.testing.assert_array_equal(_same_as_pyarrow(path, groups_fast=(3, 0)), x)
    column = pages.Column.__new__(pages.Column)
    column.dtype, column.dictionary = np.dtype("<f4"), np.arange(3, dtype="<f4")
    raw = memoryview(bytes([2, 1 << 1 | 1]) + _packed(np.array([0, 1, 2, 3]), 2))
    with pytest.raises(pages.Unsupported, match="out of range"):
        column._values(raw, 8, 4)
    np.testing.assert_array_equal(column._values(raw, 8, 3), [0, 1, 2])


@pytest.mark.parametrize("width", [1, 7, 19, 32])
def test_hybrid_longest_runs_back_to_back(width):
    # Arrow's long literal stretches: 63-group runs one after another, taken at once; here
    # four of them (values end inside the fourth), then an RLE run, then three more, the
    # third cut off by the end of the bytes (read one by one).
    rng = np.random.default_rng(width)
    runs = [rng.integers(0, 1 << width, 504, dtype=np.uint64) for _ in range(7)]
    head, nbytes = bytes([63 << 1 | 1]), (width + 7) // 8
    first = b"".join(head + _packed(r, width) for r in runs[:4])
    rle = bytes([9 << 1]) + (1).to_bytes(nbytes, "little")
    rest = b"".join(head + _packed(r, width) for r in runs[4:])
    want = np.concatenate(runs[:4]).astype(np.uint64)
    got = pages.hybrid(memoryview(first + rle), 0, len(first), width, 3 * 504 + 100)
    np.testing.assert_array_equal(got.astype(np.uint64), want[: 3 * 504 + 100])
    buf = first + rle + rest
    end = len(buf) - 63 * width + (500 * width + 7) // 8  # the last run's last 4 values gone
    want = np.concatenate([*runs[:4], np.ones(9, np.uint64), *runs[4:]])[:-4]
    got = pages.hybrid(memoryview(buf), 0, end, width, len(want))
    np.testing.assert_array_equal(got.astype(np.uint64), want)


@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_pages_before_the_start_are_not_decoded(tmp_path, monkeypatch, version):
    # Small pages (dictionary, then PLAIN): a start inside a page, one on a page boundary.
    x = _rows(30)
    path = tmp_path / "d.parquet"
    options = {"data_page_size": 256, "write_batch_size": 48, "dictionary_pagesize_limit": 512}
    pq.write_table(
        pa.table({"x": from_numpy(x, "list")}), path, row_group_size=30,
        data_page_version=version, compression="zstd", **options,
    )  # fmt: skip
    decoded = []  # the values of each page decoded (after decompressing it)
    real = pages.Column._values

    def counted(self, raw, encoding, n):
        decoded.append(n)
        return real(self, raw, encoding, n)

    monkeypatch.setattr(pages.Column, "_values", counted)
    _same_as_pyarrow(path, groups_fast=(1, 0))
    everything = len(decoded)
    for start in (0, 7, 8, 21, 29):
        got = _same_as_pyarrow(path, start=start, groups_fast=(1, 0))
        np.testing.assert_array_equal(got, x[start:])
    decoded.clear()
    np.testing.assert_array_equal(_read(path, start=21)[0], x[21:])
    assert len(decoded) < everything / 2


def test_read_groups_reuse_a_finished_block_s_buffer_never_a_live_one(tmp_path, monkeypatch):
    # A Ray worker's next block goes into the buffer of the one it has finished with (new
    # memory is zeroed by the kernel page by page); a block still alive keeps its own.
    from enginekit.dataset import parquet

    monkeypatch.setattr(parquet, "SPARE_MIN_BYTES", 0)
    monkeypatch.setattr(parquet, "_spares", {})
    x = _rows(12)
    pq.write_table(pa.table({"x": from_numpy(x, "list")}), tmp_path / "a.parquet", row_group_size=4)
    f = str(tmp_path / "a.parquet")

    def address(t: pa.Table) -> int:
        return t.column("x").chunk(0).buffers()[-1].address  # the values, under the lists

    first = parquet.read_groups([(f, 0, 0, 4)], ["x"])
    live = parquet.read_groups([(f, 1, 0, 4)], ["x"])  # `first` alive: a buffer of its own
    assert address(live) != address(first)
    np.testing.assert_array_equal(np.asarray(first.column("x").to_pylist()), x[:4])
    used = address(live)
    del live
    again = parquet.read_groups([(f, 2, 0, 4)], ["x"])
    assert address(again) == used
    np.testing.assert_array_equal(np.asarray(again.column("x").to_pylist()), x[8:])


def test_page_headers_are_parsed_from_unsigned_bytes(tmp_path):
    # A Thrift field header byte of 0x80 or more (a field id 8 or more past the last one) read
    # as a signed byte would give a negative field id: the file's bytes are viewed unsigned.
    from enginekit.dataset.parquet import _map

    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"x": from_numpy(np.ones((4, 2), np.float32), "list")}), path)
    data = _map(path)
    assert data.format == "B" and data[0] == ord("P")
    # field 9 (delta 9 from 0, i32 = 5) holding 1 (zigzag 2), then the struct's end
    head = bytes([0x95, 0x02, 0x00])
    assert pages.struct_at(memoryview(head), 0) == ({9: 1}, 3)
