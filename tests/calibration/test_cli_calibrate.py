"""`enginekit calibrate` and the int8 flags of `enginekit build`, with their exit codes."""

from __future__ import annotations

import json

import calib_models
import numpy as np
import pytest

import enginekit as ek
from enginekit.calibration.writers import read_trt_cache
from enginekit.cli import main
from enginekit.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_VERIFY

# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
other_model_path = calib_models.other_model_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table


@pytest.fixture(scope="module")
def npz(tmp_path_factory, calib_x):
    path = tmp_path_factory.mktemp("cli") / "calib.npz"
    np.savez(path, x=calib_x)
    return path


def test_calibrate_writes_table_qdq_and_caches(tiny_cnn_path, npz, tmp_path, capsys):
    out = tmp_path / "calib.json"
    code = main([
        "calibrate", str(tiny_cnn_path), "--data", str(npz), "--method", "percentile",
        "-o", str(out), "--qdq", str(tmp_path / "q.onnx"), "--trt-cache", str(tmp_path / "c"),
        "--trt-version", "8.6.1", "--ort-trt-table", str(tmp_path / "ort"), "--json",
    ])  # fmt: skip
    assert code == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    table = ek.CalibrationTable.load(out)
    assert info["sha256"] == table.sha256 and table.method == "percentile"
    assert table.samples == 64
    assert read_trt_cache(tmp_path / "c")[0] == "TRT-8601-EntropyCalibration2"
    assert (tmp_path / "q.onnx").stat().st_size > 0
    assert (tmp_path / "ort" / "calibration.flatbuffers").is_file()


def test_build_with_calibration_table_and_with_calib_data(tiny_cnn_path, npz, tmp_path, capsys):
    table = ek.calibrate(tiny_cnn_path, npz).save(tmp_path / "calib.json")
    code = main([
        "build", str(tiny_cnn_path), "--precision", "int8", "--calibration", str(table),
        "--verify-data", str(npz), "-o", str(tmp_path / "a.ekit"),
    ])  # fmt: skip
    assert code == EXIT_OK
    text = capsys.readouterr().out
    assert "int8 (entropy table" in text and "top-1 agreement" in text
    code = main([
        "build", str(tiny_cnn_path), "--precision", "int8", "--calib-data", str(npz),
        "--calib-method", "minmax", "-o", str(tmp_path / "b.ekit"),
    ])  # fmt: skip
    assert code == EXIT_OK
    assert "held-out calibration samples" in capsys.readouterr().out
    assert ek.load(tmp_path / "b.ekit").manifest["calibration"]["method"] == "minmax"


def test_gate_miss_exits_3_and_bad_table_exits_1(tiny_cnn_path, npz, tmp_path, capsys):
    code = main([
        "build", str(tiny_cnn_path), "--precision", "int8", "--calib-data", str(npz),
        "--max-abs-error", "1e-9", "-o", str(tmp_path / "m.ekit"),
    ])  # fmt: skip
    assert code == EXIT_VERIFY and "max_abs_error" in capsys.readouterr().err
    assert not (tmp_path / "m.ekit").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code = main([
        "build", str(tiny_cnn_path), "--precision", "int8", "--calibration", str(bad),
        "-o", str(tmp_path / "m.ekit"),
    ])  # fmt: skip
    assert code == EXIT_FAILURE and "CalibrationError" in capsys.readouterr().err


def test_backends_lists_onnxruntime_precisions(capsys):
    assert main(["backends", "--json"]) == EXIT_OK
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    ort = rows["onnxruntime"]  # bf16 needs CUDA: ONNX Runtime's CPU provider has no bf16 kernels
    want = (
        ["fp32", "fp16", "bf16", "int8"] if "cuda" in ort["devices"] else ["fp32", "fp16", "int8"]
    )
    assert ort["precisions"] == want
