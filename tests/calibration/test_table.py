"""CalibrationTable: contents, JSON round trip, model binding, corrupted files."""

from __future__ import annotations

import json

import calib_models
import numpy as np
import pytest

import enginekit as ek
from enginekit.calibration.table import FORMAT_VERSION, CalibrationTable, as_table
from enginekit.errors import CalibrationError
from enginekit.model import load_model

# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
other_model_path = calib_models.other_model_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table


def test_table_covers_every_activation_and_weight(tiny_table, tiny_cnn_path, calib_x):
    assert set(tiny_table.tensors) == {"x", "c1", "r1", "c2", "s", "r2", "p", "f", "logits"}
    assert set(tiny_table.weights) == {"w1", "w2", "wf"}
    assert tiny_table.model_sha256 == load_model(tiny_cnn_path).sha256
    assert (tiny_table.samples, tiny_table.batches, tiny_table.method) == (64, 4, "entropy")
    x = tiny_table["x"]
    assert (x.min, x.max) == (float(calib_x.min()), float(calib_x.max()))
    assert 0 < x.amax <= max(-x.min, x.max)
    assert tiny_table.scale("x") == pytest.approx(x.amax / 127)
    assert tiny_table["r1"].min == 0.0  # a ReLU output


def test_weight_ranges_are_per_output_channel(tiny_table, tiny_cnn_path):
    from onnx import numpy_helper

    w1 = next(t for t in load_model(tiny_cnn_path).proto.graph.initializer if t.name == "w1")
    expected = np.abs(numpy_helper.to_array(w1)).reshape(8, -1).max(axis=1)
    assert tiny_table.weights["w1"].axis == 0
    assert np.allclose(tiny_table.weights["w1"].amax, expected)


def test_save_load_round_trip_keeps_the_hash(tiny_table, tmp_path):
    path = tiny_table.save(tmp_path / "calib.json")
    back = CalibrationTable.load(path)
    assert back.sha256 == tiny_table.sha256
    for name, r in tiny_table.tensors.items():
        b = back[name]
        assert (b.min, b.max, b.amax) == (r.min, r.max, r.amax)
        assert np.array_equal(b.histogram.counts, r.histogram.counts)
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION
    assert as_table(str(path)).sha256 == tiny_table.sha256


def test_other_methods_from_the_same_histograms(tiny_table):
    minmax = tiny_table.with_method("minmax")
    pct = tiny_table.with_method("percentile", 99.0)
    for name, r in tiny_table.tensors.items():
        assert minmax.amax(name) == max(-r.min, r.max)
        assert pct.amax(name) <= minmax.amax(name)
    assert pct.method == "percentile" and pct.percentile == 99.0
    assert pct.sha256 != tiny_table.sha256


def test_minmax_table_cannot_switch_to_histogram_methods(tiny_cnn_path, calib_x):
    table = ek.calibrate(tiny_cnn_path, calib_x, method="minmax")
    assert all(r.histogram is None for r in table.tensors.values())
    with pytest.raises(CalibrationError, match="needs histograms"):
        table.with_method("entropy")


def test_table_for_another_model_is_refused_unless_overridden(tiny_table, other_model_path):
    other = load_model(other_model_path).sha256
    with pytest.raises(CalibrationError, match="made for model"):
        tiny_table.check_model(other)
    tiny_table.check_model(other, allow_mismatch=True)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": "enginekit-calibration", "format_version": 1, "tens', "not valid JSON"),
        ("\x00\x01garbage", "not valid JSON"),
        ('{"hello": 1}', "not an enginekit calibration table"),
        ('{"format": "enginekit-calibration", "format_version": 99}', "format version 99"),
    ],
    ids=["truncated", "binary", "other-json", "newer-version"],
)
def test_corrupted_table_files_raise_calibration_error(tmp_path, text, match):
    path = tmp_path / "calib.json"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=match):
        CalibrationTable.load(path)


def test_malformed_entries_are_named(tiny_table, tmp_path):
    data = tiny_table.to_json()
    data["tensors"]["c1"]["amax"] = "NaN"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="malformed tensor entry"):
        CalibrationTable.load(path)
    data = tiny_table.to_json()
    del data["model_sha256"]
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="malformed table"):
        CalibrationTable.load(path)


def test_missing_table_file_and_wrong_argument_type(tmp_path):
    with pytest.raises(CalibrationError, match="cannot read"):
        CalibrationTable.load(tmp_path / "nope.json")
    with pytest.raises(CalibrationError, match="expected a CalibrationTable"):
        as_table(42)  # type: ignore[arg-type]


def test_unknown_tensor_lookup_says_so(tiny_table):
    with pytest.raises(CalibrationError, match="no tensor 'nope'"):
        tiny_table.amax("nope")
