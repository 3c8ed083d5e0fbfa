"""Calibration data sources and their checks against the model's inputs."""

from __future__ import annotations

import calib_models
import numpy as np
import pytest

import enginekit as ek
from enginekit.calibration.data import Chunking, Holdout, batches
from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import CalibrationError

# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
other_model_path = calib_models.other_model_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table


X = TensorSpec("x", "float32", ("batch", 3, 8, 8))
TWO = (TensorSpec("a", "float32", ("batch", 4)), TensorSpec("b", "int64", ("batch", 2)))


def _rows(stream) -> list[int]:
    return [next(iter(f.values())).shape[0] for f in stream]


def test_array_is_split_into_batches():
    data = np.zeros((70, 3, 8, 8), np.float32)
    assert _rows(batches(data, [X], batch_size=32)) == [32, 32, 6]


def test_dict_of_arrays_for_several_inputs():
    data = {"a": np.zeros((5, 4), np.float32), "b": np.zeros((5, 2), np.int64)}
    out = list(batches(data, TWO, batch_size=2))
    assert _rows(out) == [2, 2, 1] and set(out[0]) == {"a", "b"}


def test_npz_file_one_key_per_input(tmp_path):
    path = tmp_path / "calib.npz"
    np.savez(path, a=np.ones((3, 4), np.float32), b=np.ones((3, 2), np.int64))
    assert _rows(batches(path, TWO, batch_size=2)) == [2, 1]


def test_folder_of_per_input_npy_is_memory_mapped(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((7, 4), np.float32))
    np.save(tmp_path / "b.npy", np.ones((7, 2), np.int64))
    out = list(batches(tmp_path, TWO, batch_size=4))
    assert _rows(out) == [4, 3] and all(type(a) is np.ndarray for a in out[0].values())


def test_folder_of_batch_files_read_in_name_order(tmp_path):
    for i, rows in enumerate([2, 3, 1]):
        np.save(tmp_path / f"batch_{i:03d}.npy", np.full((rows, 3, 8, 8), i, np.float32))
    out = list(batches(tmp_path, [X]))
    assert _rows(out) == [2, 3, 1] and [float(f["x"][0, 0, 0, 0]) for f in out] == [0, 1, 2]


def test_iterable_of_tuples_ignores_trailing_labels():
    items = [(np.zeros((4, 3, 8, 8), np.float32), np.arange(4)) for _ in range(3)]
    assert _rows(batches(items, [X])) == [4, 4, 4]


def test_generator_stops_at_max_samples():
    def endless():
        while True:
            yield {"x": np.zeros((8, 3, 8, 8), np.float32)}

    assert _rows(batches(endless(), [X], max_samples=20)) == [8, 8, 4]


def test_single_samples_without_batch_axis():
    items = [np.zeros((3, 8, 8), np.float32) for _ in range(3)]
    assert _rows(batches(items, [X])) == [1, 1, 1]


def test_objects_with_array_protocol_are_accepted():
    class Wrapped:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    assert _rows(batches([Wrapped(np.zeros((2, 3, 8, 8), np.float32))], [X])) == [2]


def test_torch_dataloader_works_without_enginekit_importing_torch():
    torch = pytest.importorskip("torch", reason="DataLoader source")
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.zeros(10, 3, 8, 8), torch.zeros(10, dtype=torch.long))
    assert _rows(batches(DataLoader(ds, batch_size=4), [X])) == [4, 4, 2]


@pytest.mark.parametrize(
    "item, match",
    [
        (np.zeros((2, 3, 8, 8), np.float64), "dtype float64, the model takes float32"),
        (np.zeros((2, 3, 8), np.float32), r"rank 3\), the model takes rank 4"),
        (np.zeros((2, 3, 8, 9), np.float32), "dim 3 must be 8"),
        ({"y": np.zeros((2, 3, 8, 8), np.float32)}, "missing input.*'x'.*unknown input.*'y'"),
        ("not an array", "expected an array"),
    ],
    ids=["dtype", "rank", "fixed-dim", "name", "type"],
)
def test_bad_batches_are_refused_with_a_clear_error(item, match):
    with pytest.raises(CalibrationError, match=match):
        list(batches([item], [X]))


def test_missing_input_of_a_two_input_model_and_row_mismatch():
    with pytest.raises(CalibrationError, match=r"missing input.*'b'"):
        list(batches([{"a": np.zeros((2, 4), np.float32)}], TWO))
    with pytest.raises(CalibrationError, match="different numbers of rows"):
        list(batches({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 2), np.int64)}, TWO))


def test_dims_outside_the_profile_are_refused():
    spec = TensorSpec("ids", "int64", ("batch", "seq"))
    profile = {"ids": ShapeProfile((1, 2), (4, 8), (8, 16))}
    with pytest.raises(CalibrationError, match=r"dim 1 is outside the build profile 2\.\.16"):
        list(batches([np.zeros((2, 20), np.int64)], [spec], profile=profile))
    # Any number of rows: batches past the profile's max batch are split to it.
    assert _rows(batches([np.zeros((40, 8), np.int64)], [spec], profile=profile)) == [8] * 5


def test_missing_files_and_unsupported_sources(tmp_path):
    with pytest.raises(CalibrationError, match="no such file"):
        list(batches(tmp_path / "nope.npz", [X]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match=r"holds no \.npy or \.npz"):
        list(batches(tmp_path / "empty", [X]))
    with pytest.raises(CalibrationError, match="not supported"):
        list(batches(42, [X]))


def test_empty_dataset_is_an_error(tiny_cnn_path):
    with pytest.raises(CalibrationError, match="calibration data is empty"):
        ek.calibrate(tiny_cnn_path, np.zeros((0, 3, 8, 8), np.float32))
    with pytest.raises(CalibrationError, match="calibration data is empty"):
        ek.calibrate(tiny_cnn_path, iter([]))


def test_wrong_data_reaches_the_user_through_calibrate(tiny_cnn_path):
    with pytest.raises(CalibrationError, match="dtype float64"):
        ek.calibrate(tiny_cnn_path, np.zeros((4, 3, 8, 8)))


def test_holdout_takes_every_tenth_sample_whatever_the_batching():
    data = np.arange(45, dtype=np.float32)[:, None]
    for size in (1, 7, 45):
        held = Holdout(every=10, cap=100)
        kept = np.concatenate(
            [
                f["x"]
                for f in held.split(batches(data, [TensorSpec("x", "float32", ("b", 1))], size))
            ]
        )
        taken = np.concatenate([f["x"] for f in held.held])
        assert taken.ravel().tolist() == [9, 19, 29, 39]
        assert len(kept) == 41 and held.count == 4


def test_holdout_first_holds_every_second_sample_until_it_has_enough():
    data = np.arange(45, dtype=np.float32)[:, None]
    for size in (1, 7, 45):
        held = Holdout(every=10, cap=100, first=5)
        kept = sum(
            len(f["x"])
            for f in held.split(batches(data, [TensorSpec("x", "float32", ("b", 1))], size))
        )
        taken = np.concatenate([f["x"] for f in held.held])
        assert taken.ravel().tolist() == [1, 3, 5, 7, 9, 19, 29, 39]
        assert kept == 37 and held.count == 8


def test_holdout_fit_keeps_the_first_calibration_samples_and_no_held_out_one():
    data = np.arange(45, dtype=np.float32)[:, None]
    for size in (1, 7, 45):
        held = Holdout(every=10, cap=100, first=5, fit=6)
        for _ in held.split(batches(data, [TensorSpec("x", "float32", ("b", 1))], size)):
            pass
        fitted = np.concatenate([f["x"] for f in held.fitted]).ravel().tolist()
        assert fitted == [0, 2, 4, 6, 8, 10] and held.fit_count == 6
        assert not set(fitted) & set(np.concatenate([f["x"] for f in held.held]).ravel())


def test_data_hash_depends_on_the_data(tiny_cnn_path, calib_x):
    a = ek.calibrate(tiny_cnn_path, calib_x, method="minmax")
    b = ek.calibrate(tiny_cnn_path, calib_x[:32], method="minmax")
    c = ek.calibrate(tiny_cnn_path, list(np.split(calib_x, 4)), method="minmax")
    assert a.data_sha256 != b.data_sha256
    assert a.samples == 64 and b.samples == 32
    assert a["x"].amax == c["x"].amax and a["logits"].max == pytest.approx(c["logits"].max)


FIXED1 = TensorSpec("x", "float32", (1, 4))
FIXED4 = TensorSpec("x", "float32", (4, 4))


def test_any_row_count_is_cut_to_a_fixed_batch_of_1():
    data = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    chunking = Chunking()
    got = list(batches(data, [FIXED1], chunking=chunking))
    assert [b["x"].shape for b in got] == [(1, 4)] * 16
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), data)
    assert chunking.rows == 16 and chunking.note() == ""


def test_fixed_batch_remainder_is_dropped_or_padded_and_said(caplog):
    data = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    # Source batches of 3 rows do not line up with the model's 4: rows are re-cut across them.
    source = [data[i : i + 3] for i in range(0, 10, 3)]
    dropped = Chunking()
    with caplog.at_level("WARNING"):
        got = list(batches(source, [FIXED4], chunking=dropped))
    assert [b["x"].shape[0] for b in got] == [4, 4]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), data[:8])
    assert dropped.dropped == 2 and "dropped the last 2" in dropped.note()
    assert "fixed at 4" in caplog.text
    padded = Chunking()
    got = list(batches(data, [FIXED4], remainder="pad", chunking=padded))
    assert [b["x"].shape[0] for b in got] == [4, 4, 4]
    np.testing.assert_array_equal(got[-1]["x"], data[[8, 9, 8, 9]])
    assert padded.padded == 2 and "padded 2" in padded.note()
    # Fewer rows than one chunk: padded whatever remainder= says.
    (only,) = list(batches(data[:3], [FIXED4]))
    np.testing.assert_array_equal(only["x"], data[[0, 1, 2, 0]])


def test_calibrating_a_fixed_batch_model_records_the_chunking(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    import enginekit as ek

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "fixed4.onnx"
    onnx.save(model, path)
    rows = np.random.default_rng(0).standard_normal((18, 4)).astype(np.float32)
    table = ek.calibrate(path, rows, method="minmax")
    assert table.samples == 16 and table.batches == 4
    assert "dropped the last 2" in table.chunking
    assert table.manifest_entry()["chunking"] == table.chunking
    assert ek.CalibrationTable.from_json(table.to_json()).chunking == table.chunking
    padded = ek.calibrate(path, rows, method="minmax", remainder="pad")
    assert padded.samples == 20 and "padded 2" in padded.chunking


def test_int8_build_of_a_fixed_batch_1_model_takes_16_calibration_rows(tmp_path):
    import onnx

    model = calib_models.tiny_cnn()
    for v in (model.graph.input[0], model.graph.output[0]):
        v.type.tensor_type.shape.dim[0].Clear()
        v.type.tensor_type.shape.dim[0].dim_value = 1
    path = tmp_path / "fixed1.onnx"
    onnx.save(model, path)
    rows = np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32)
    engine = ek.build(path, precision="int8", calib_data=rows)
    calib = engine.manifest["calibration"]
    assert calib["samples"] == 15  # every 10th row held out for the accuracy check
    assert engine.infer(rows[:1])["logits"].shape == (1, 4)
