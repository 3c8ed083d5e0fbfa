"""Every source and sink of ``infer_dataset``, and the typed errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
from dataset_helpers import cnn_rows, naive, read_output, tensor_column, write_parquet

import enginekit as ek

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
from enginekit.errors import DatasetError, UsageError


@pytest.fixture(scope="module")
def cnn(ekit):
    with ek.load(ekit("cnn")) as engine:
        yield engine


def test_parquet_folder_rows_come_out_in_order_with_id_columns(cnn, tmp_path):
    x = cnn_rows(50)
    for i, (lo, hi) in enumerate([(0, 20), (20, 21), (21, 50)]):
        write_parquet(
            tmp_path / "src" / f"f{i}.parquet",
            {"key": [f"k{j}" for j in range(lo, hi)], "x": tensor_column(x[lo:hi])},
            row_group_size=7,
        )
    s = ek.infer_dataset(cnn, tmp_path / "src", tmp_path / "out", batch_size=8, shard_rows=16)
    assert (s.rows, s.shards, s.batch_size) == (50, 4, 8)
    got = read_output(tmp_path / "out")
    assert list(got) == ["key", "output"]
    assert got["key"].tolist() == [f"k{j}" for j in range(50)]
    np.testing.assert_array_equal(got["output"], naive(cnn, {"x": x}, 8)["output"])


def test_parquet_column_mapping_and_tensor_extension_output(cnn, tmp_path):
    import pyarrow.parquet as pq

    x = cnn_rows(12)
    write_parquet(tmp_path / "d.parquet", {"pixels": tensor_column(x), "n": np.arange(12)})
    ek.infer_dataset(
        cnn, tmp_path / "d.parquet", tmp_path / "out", batch_size=4,
        columns={"x": "pixels"}, tensor_format="tensor",
    )  # fmt: skip
    table = pq.read_table(tmp_path / "out")
    assert table.column_names == ["n", "output"]
    assert str(table.schema.field("output").type).startswith("extension<arrow.fixed_shape_tensor")
    np.testing.assert_array_equal(
        read_output(tmp_path / "out")["output"], naive(cnn, {"x": x}, 4)["output"]
    )


def test_npy_npz_files_and_folders(ekit, cnn, tmp_path):
    x = cnn_rows(20)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "npz").mkdir()
    np.savez(tmp_path / "npz" / "a.npz", x=x[:9])
    np.savez(tmp_path / "npz" / "b.npz", x=x[9:])
    expected = naive(cnn, {"x": x}, 8)["output"]
    for i, src in enumerate([tmp_path / "x.npy", tmp_path / "npz"]):
        s = ek.infer_dataset(cnn, src, tmp_path / f"out{i}", batch_size=8, format="npz")
        assert s.rows == 20
        shards = sorted((tmp_path / f"out{i}").glob("part-*.npz"))
        parts = [np.load(p) for p in shards]
        np.testing.assert_array_equal(np.concatenate([p["output"] for p in parts]), expected)
        assert np.concatenate([p["id.row"] for p in parts]).tolist() == list(range(20))
    # Two inputs from one .npz, one of them under another key.
    with ek.load(ekit("two_input")) as two:
        rng = np.random.default_rng(1)
        a = rng.standard_normal((10, 8)).astype(np.float32)
        b = rng.standard_normal((10, 4)).astype(np.float32)
        np.savez(tmp_path / "ab.npz", a=a, bee=b)
        ek.infer_dataset(
            two, tmp_path / "ab.npz", tmp_path / "ab", batch_size=4, columns={"b": "bee"}
        )
        got = read_output(tmp_path / "ab")
        ref = naive(two, {"a": a, "b": b}, 4)
        for k, v in ref.items():
            np.testing.assert_array_equal(got[k], v)


def test_image_folder_with_declared_preprocessing(cnn, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    folder = tmp_path / "imgs"
    (folder / "cats").mkdir(parents=True)
    (folder / "dogs").mkdir()
    for i in range(7):
        pixels = rng.integers(0, 256, (24 + i, 30, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / ("cats" if i % 2 else "dogs") / f"{i}.png")
    prep = ek.ImagePreprocess(resize=20, crop=16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    s = ek.infer_dataset(
        cnn, folder, tmp_path / "out", batch_size=4, preprocess=prep, decode_workers=2
    )
    assert s.rows == 7
    got = read_output(tmp_path / "out")
    paths = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    assert got["path"].tolist() == paths
    # The same preprocessing by hand: shorter side to 20, center 16x16, /255, mean/std, CHW.
    rows = []
    for p in paths:
        im = Image.open(folder / p).convert("RGB")
        w, h = im.size
        im = im.resize(
            (round(w * 20 / min(w, h)), round(h * 20 / min(w, h))), Image.Resampling.BILINEAR
        )
        w, h = im.size
        im = im.crop(((w - 16) // 2, (h - 16) // 2, (w - 16) // 2 + 16, (h - 16) // 2 + 16))
        a = (np.asarray(im, np.float32) / 255 - [0.5, 0.4, 0.3]) / [0.2, 0.25, 0.3]
        rows.append(a.transpose(2, 0, 1).astype(np.float32))
    np.testing.assert_allclose(
        got["output"], naive(cnn, {"x": np.stack(rows)}, 4)["output"], rtol=1e-5, atol=1e-5
    )
    # Decoding in worker processes gives the same rows.
    ek.infer_dataset(
        cnn,
        folder,
        tmp_path / "procs",
        batch_size=4,
        preprocess=prep,
        decode_workers=2,
        decode_processes=True,
    )
    np.testing.assert_array_equal(read_output(tmp_path / "procs")["output"], got["output"])


def test_iterable_of_batches_any_sizes_with_id_keys(cnn, tmp_path):
    x = cnn_rows(23)
    batches = [
        {"x": x[i : i + 5], "name": np.array([f"n{j}" for j in range(i, min(i + 5, 23))])}
        for i in range(0, 23, 5)
    ]
    s = ek.infer_dataset(cnn, iter(batches), tmp_path / "out", batch_size="auto")
    assert s.rows == 23 and 1 <= s.batch_size <= 8
    got = read_output(tmp_path / "out")
    assert got["name"].tolist() == [f"n{j}" for j in range(23)]
    np.testing.assert_allclose(got["output"], cnn.infer(x)["output"], rtol=1e-5, atol=1e-6)
    # Plain arrays carry a row index.
    ek.infer_dataset(cnn, [x[:3], x[3:10]], tmp_path / "plain", batch_size=4)
    assert read_output(tmp_path / "plain")["row"].tolist() == list(range(10))


def test_wrong_column_name_suggests_the_closest(cnn, tmp_path):
    write_parquet(tmp_path / "d.parquet", {"x_": tensor_column(cnn_rows(4))})
    with pytest.raises(DatasetError, match=r"no column 'x'.*closest: 'x_'.*--column x=COLUMN"):
        ek.infer_dataset(cnn, tmp_path / "d.parquet", tmp_path / "out", batch_size=2)
    with pytest.raises(UsageError, match=r"input 'xx'.*closest: 'x'"):
        ek.infer_dataset(cnn, tmp_path / "d.parquet", tmp_path / "out2", columns={"xx": "x_"})


def test_dtype_and_shape_mismatches_say_what_to_do(cnn, tmp_path):
    write_parquet(tmp_path / "f64.parquet", {"x": tensor_column(cnn_rows(4).astype(np.float64))})
    with pytest.raises(DatasetError, match=r"holds float64.*takes float32.*cast=True"):
        ek.infer_dataset(cnn, tmp_path / "f64.parquet", tmp_path / "o1", batch_size=2)
    s = ek.infer_dataset(cnn, tmp_path / "f64.parquet", tmp_path / "o2", batch_size=2, cast=True)
    assert s.rows == 4
    write_parquet(
        tmp_path / "shape.parquet", {"x": tensor_column(np.zeros((4, 3, 8, 8), np.float32))}
    )
    with pytest.raises(DatasetError, match=r"dim 2 must be 16"):
        ek.infer_dataset(cnn, tmp_path / "shape.parquet", tmp_path / "o3", batch_size=2)


def test_unreadable_files_are_named(cnn, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"a\.parquet: cannot read it"):
        ek.infer_dataset(cnn, tmp_path / "bad", tmp_path / "o1", batch_size=2)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DatasetError, match=r"broken\.png: cannot decode"):
        ek.infer_dataset(cnn, tmp_path / "imgs", tmp_path / "o2", batch_size=2, decode_workers=0)
    with pytest.raises(DatasetError, match="no such file"):
        ek.infer_dataset(cnn, tmp_path / "missing.parquet", tmp_path / "o3")


def test_existing_output_needs_resume_or_overwrite(cnn, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(6))
    ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "out", batch_size=2)
    with pytest.raises(DatasetError, match=r"already holds.*--resume.*--overwrite"):
        ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "out", batch_size=2)
    s = ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "out", batch_size=2, overwrite=True)
    assert s.shards_written == 1
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "out", batch_size=2, overwrite=True)
    assert (tmp_path / "out" / "notes.txt").exists()


@pytest.mark.parametrize(
    "prep",
    [
        ek.ImagePreprocess(resize=20, crop=16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)),
        ek.ImagePreprocess(resize=(12, 10), layout="NHWC", dtype="uint8"),
        ek.ImagePreprocess(resize=16, crop=16, mode="L"),
    ],
)
def test_a_batch_decodes_to_the_same_values_as_its_images_one_by_one(tmp_path, prep):
    from PIL import Image

    from enginekit.dataset.images import decode_many

    rng = np.random.default_rng(1)
    paths = []
    for i in range(5):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)).save(paths[-1])
    batch = decode_many(prep, paths)
    np.testing.assert_array_equal(batch, np.stack([prep(p) for p in paths]))
    assert batch.dtype == np.dtype(prep.dtype) and batch.flags.c_contiguous


def test_output_columns_are_written_without_a_dictionary_ids_with(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from enginekit.dataset.sinks import write_shard

    labels = pa.array(["cat", "dog"] * 50)
    write_shard(
        tmp_path / "s.parquet", {"label": labels}, {"y": np.ones((100, 3), np.float32)}, "parquet"
    )
    meta = pq.ParquetFile(tmp_path / "s.parquet").metadata.row_group(0)
    encodings = {
        meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)
    }
    assert not any("DICTIONARY" in e for e in encodings["y.list.element"])
    assert any("DICTIONARY" in e for e in encodings["label"])
    assert pq.read_table(tmp_path / "s.parquet").column("label").to_pylist() == labels.to_pylist()
