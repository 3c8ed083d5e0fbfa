"""Pages decompressed straight into the read buffer (cramjam): byte-identical to pyarrow's rows
for every layout, codec and cut, and the old path (or pyarrow) for what does not fit."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
pytest.importorskip("cramjam", reason="enginekit[data] installs cramjam")
import pyarrow as pa
import pyarrow.parquet as pq

from enginekit.dataset import pages, parquet
from enginekit.dataset.columns import from_numpy
from enginekit.dataset.parquet import ParquetSource, read_groups
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError

SPEC = [TensorSpec("x", "float32", ("batch", 3, 4, 5))]
#: Small PLAIN v1 pages: several to a read, pages cut by reads and row groups.
SMALL = {"use_dictionary": False, "data_page_size": 700, "write_batch_size": 20}


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 4, 5)).astype(np.float32)


def _write(path, x, row_group_size, **options):
    table = pa.table({"id": np.arange(len(x)), "x": from_numpy(x, "list")})
    pq.write_table(table, path, row_group_size=row_group_size, **options)
    return path


@pytest.fixture
def counted(monkeypatch):
    """Pages decompressed straight into a buffer, by codec."""
    calls: dict = {}
    for codec, fn in list(pages.INTO.items()):

        def wrapped(page, out, fn=fn, codec=codec):
            calls[codec] = calls.get(codec, 0) + 1
            return fn(page, out)

        monkeypatch.setitem(pages.INTO, codec, wrapped)
    return calls


def _pieces(path, start=0, size=7):
    src = ParquetSource(path, SPEC, None, None, False)
    got = list(src.pieces(start, size))
    ids = np.concatenate([np.asarray(p.ids["id"]) for p in got])
    return np.concatenate([p.inputs["x"] for p in got]), ids, src


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)  # byte-identical, not just equal


@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip", "brotli", "none"])
@pytest.mark.parametrize("start, size", [(0, 7), (0, 1), (13, 5), (0, 64)])
def test_pages_into_the_batch_match_pyarrow(tmp_path, counted, codec, start, size):
    # 61 rows (odd), row groups of 23, pages of ~3 rows: several pages per read, pages cut by
    # reads (their rest stays in the scratch after the read), reads cut by row groups.
    x = _rows(61)
    path = _write(tmp_path / "d.parquet", x, 23, compression=codec, **SMALL)
    got, ids, src = _pieces(path, start, size)
    ref = pq.read_table(path).slice(start)
    want = np.asarray(ref.column("x").to_pylist(), np.float32)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(got), _bits(x[start:]))
    np.testing.assert_array_equal(ids, np.arange(start, 61))
    assert (src.groups_fast, src.groups_arrow) == (3 - start // 23, 0)
    name = None if codec == "none" else codec
    assert counted.get(name, 0) > 10  # most pages went straight into the batch


@pytest.mark.parametrize("version", ["1.0", "2.0"])
@pytest.mark.parametrize("start, size", [(0, 7), (0, 1), (4, 64)])
def test_dictionary_pages_looked_up_into_the_batch_match_pyarrow(tmp_path, version, start, size):
    # Dictionary-encoded pages first (pyarrow's default), then PLAIN once the dictionary is
    # full; the indices looked up straight into the read buffer, reads cutting pages.
    x = _rows(45)
    x[::3] = x[1]  # repeated rows: some pages' indices repeat (RLE runs)
    options = {"data_page_size": 300, "write_batch_size": 20, "dictionary_pagesize_limit": 2000}
    path = _write(tmp_path / "d.parquet", x, 30, data_page_version=version, **options)
    got, ids, src = _pieces(path, start, size)
    np.testing.assert_array_equal(_bits(got), _bits(x[start:]))
    np.testing.assert_array_equal(ids, np.arange(start, 45))
    assert src.groups_arrow == 0


@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip", "brotli", "lz4_raw"])
def test_each_decompressor_writes_exactly_the_page_or_raises(codec):
    # (pyarrow's metadata names an LZ4_RAW chunk "LZ4", which the page reader leaves to
    # pyarrow: lz4_raw is checked here against pyarrow's compressor.)
    data = _rows(50).tobytes()
    page = memoryview(pa.compress(data, codec=codec, asbytes=True))
    out = np.full(len(data) + 2, 0xEE, np.uint8)
    assert pages.INTO[codec](page, out[1:-1]) == len(data)
    assert out[1:-1].tobytes() == data and out[0] == out[-1] == 0xEE
    with pytest.raises(pages.INTO_ERRORS):  # a buffer too small is refused, not overrun
        pages.INTO[codec](page, out[1:-2])


def test_without_cramjam_the_pages_are_copied_and_read_the_same(tmp_path, monkeypatch, counted):
    x = _rows(40)
    path = _write(tmp_path / "d.parquet", x, 17, **SMALL)
    with_into, _, _ = _pieces(path)
    assert counted.get("snappy", 0) > 10
    monkeypatch.setattr(pages, "INTO", {})
    counted.clear()
    without, _, _ = _pieces(path)
    assert not counted
    np.testing.assert_array_equal(_bits(without), _bits(with_into))
    np.testing.assert_array_equal(_bits(without), _bits(x))


def test_decompressors_without_cramjam(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cramjam", None)  # import cramjam -> ImportError
    assert pages._decompressors() == ({}, ())


def test_levels_go_into_earlier_values_and_the_first_page_needs_room(tmp_path, counted):
    # take() into a plain array: no room before its first value, so the first page is
    # decompressed apart and copied; every later one lands in place, levels in front of it.
    x = _rows(30)
    path = _write(tmp_path / "d.parquet", x, 30, **SMALL)
    pf = pq.ParquetFile(path)
    leaf = parquet._tensor_leaves(pf, ["x"])["x"]
    chunk = pf.metadata.row_group(0).column(leaf.index)

    def column():
        return pages.Column(parquet._map(path), chunk, leaf.max_def, leaf.max_rep)

    n_pages = len(list(column().walk()))
    assert n_pages > 4
    got = parquet._Values(column()).take(30 * 60)
    np.testing.assert_array_equal(_bits(got), _bits(x.reshape(-1)))
    assert counted["snappy"] == n_pages - 1
    # With room before the first value, all of them.
    counted.clear()
    buf = np.full(parquet.HEAD_BYTES + 30 * 60 * 4, 0xEE, np.uint8)
    got = parquet._Values(column()).fill(buf, parquet.HEAD_BYTES, 30 * 60)
    np.testing.assert_array_equal(_bits(got), _bits(x.reshape(-1)))
    assert counted["snappy"] == n_pages


def test_read_groups_across_row_groups_and_files_match_pyarrow(tmp_path, counted):
    x = _rows(50)
    files = []
    for i, (lo, hi) in enumerate([(0, 29), (29, 50)]):
        files.append(str(_write(tmp_path / f"{i}.parquet", x[lo:hi], 11, **SMALL)))
    pieces = [(files[0], 0, 3, 8), (files[0], 1, 0, 11), (files[0], 2, 0, 7), (files[1], 0, 5, 6)]
    got = read_groups(pieces, ["x", "id"])
    ref = pa.concat_tables(
        [pq.ParquetFile(f).read_row_group(g).slice(s, n) for f, g, s, n in pieces]
    )
    assert got.equals(ref.select(["x", "id"]))
    assert got.column("x").num_chunks == 1
    assert counted["snappy"] > 10


def test_nulls_in_a_plain_page_fall_back_to_pyarrow_and_its_error(tmp_path, counted):
    x = _rows(12).reshape(12, 60)
    values = pa.array(x.reshape(-1), mask=np.arange(x.size) == 400)  # one null, in row 6
    col = pa.FixedSizeListArray.from_arrays(values, 60)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": col}), path, **SMALL)
    spec = [TensorSpec("x", "float32", ("batch", 60))]
    src = ParquetSource(path, spec, None, None, False)
    with pytest.raises(DatasetError, match="null"):
        list(src.pieces(0, 2))
    assert counted["snappy"] > 0  # pages before the null's went in place


def _first_data_page(path):
    """The first data page's body: (offset in the file, compressed size)."""
    data = parquet._map(path)
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(1)
    header, body = pages.struct_at(data, chunk.data_page_offset)
    return body, header[3]


@pytest.mark.parametrize("codec", ["snappy", "zstd"])
def test_a_corrupt_or_truncated_page_is_a_typed_error(tmp_path, codec):
    x = _rows(30)
    path = _write(tmp_path / "d.parquet", x, 30, compression=codec, **SMALL)
    body, size = _first_data_page(path)
    raw = bytearray(path.read_bytes())
    bad = bytearray(raw)
    bad[body : body + 8] = b"\xff" * 8  # the page's stream header: not a stream of its size
    (tmp_path / "bad.parquet").write_bytes(bytes(bad))
    with pytest.raises(DatasetError, match="bad.parquet"):
        _pieces(tmp_path / "bad.parquet")
    # Cut inside the data: the footer is gone, the file is refused when the source opens it.
    (tmp_path / "cut.parquet").write_bytes(bytes(raw[: body + size // 2]))
    with pytest.raises(DatasetError, match="cut.parquet"):
        ParquetSource(tmp_path / "cut.parquet", SPEC, None, None, False)


def test_a_page_its_codec_refuses_is_read_by_pyarrow_s_decompressor(tmp_path, monkeypatch):
    # A page cramjam cannot decompress (here: made to fail) is decompressed by pyarrow and
    # copied: the same rows.
    import cramjam

    def refuse(page, out):
        raise cramjam.DecompressionError("test")

    monkeypatch.setitem(pages.INTO, "snappy", refuse)
    x = _rows(25)
    path = _write(tmp_path / "d.parquet", x, 10, **SMALL)
    got, _, src = _pieces(path)
    np.testing.assert_array_equal(_bits(got), _bits(x))
    assert (src.groups_fast, src.groups_arrow) == (3, 0)


def test_read_buffers_are_reused_once_the_last_view_is_gone(tmp_path):
    # A page's rest kept after a read views that read's buffer; once taken, the buffer goes
    # back to the pool (an empty view would keep it from being reused).
    x = _rows(200)
    path = _write(tmp_path / "d.parquet", x, 200, **SMALL)
    src = ParquetSource(path, SPEC, None, None, False)
    seen = set()
    for p in src.pieces(0, 8):
        seen.add(p.inputs["x"].__array_interface__["data"][0] - parquet.HEAD_BYTES)
        del p
    assert len(seen) <= 3


def test_the_benchmark_s_reader_ab_runs_both_paths(tmp_path, counted):
    # benchmarks/dataset_pages.py: the copy path really copies (no page decompressed in
    # place), the into path does; both read the same rows.
    import sys

    from compare_helpers import ROOT
    from script_loader import load_script

    script = load_script(ROOT / "benchmarks" / "dataset_pages.py", "bench_dataset_pages")
    try:
        script.bench.make_parquet(tmp_path / "d", 600, files=2)  # the benchmark's rows
        with script.path("copy"):
            assert pages.INTO == {}
            assert script.read_once(tmp_path / "d", 64) > 0
        assert not counted
        with script.path("into"):
            assert script.read_once(tmp_path / "d", 64) > 0
        assert counted["snappy"] >= 4
        got = script.reader_ab(tmp_path / "d", 2, batch=64)
        assert len(got["ratios"]) == 2 and got["ratio"] > 0
        assert set(pages.INTO) == set(script._INTO)  # restored
    finally:  # the script put benchmarks/ on sys.path and imported benchmarks/dataset.py
        sys.modules.pop("bench_dataset_pages", None)
        sys.modules.pop("dataset", None)
        while str(ROOT / "benchmarks") in sys.path:
            sys.path.remove(str(ROOT / "benchmarks"))
