"""``ek.profile`` and ``enginekit profile``: per-op tables from each backend's own profiler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import CASES

import enginekit as ek
from enginekit import backends
from enginekit.evaluate.profile import matmul_peak, supported

SHAPES = CASES["cnn"].shapes
PROFILED = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not backends.availability(name).available, reason=f"{name} is not installed"
        ),
    )
    for name in ("onnxruntime", "openvino")
]


@pytest.fixture(scope="module")
def artifacts(onnx_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    cache: dict[str, Path] = {}

    def get(backend: str) -> Path:
        if backend not in cache:
            cache[backend] = out / f"cnn-{backend}.ekit"
            ek.build(onnx_model("cnn"), backend=backend, shapes=SHAPES, output=cache[backend])
        return cache[backend]

    return get


@pytest.mark.parametrize("backend", PROFILED)
def test_profile_tables_every_op_with_shares_and_conv_gflops(backend, artifacts):
    report = ek.profile(artifacts(backend), batch=4, runs=3, warmup=1)
    assert report.backend == backend and report.shapes == {"x": (4, 3, 16, 16)}
    assert report.ops and report.op_ms > 0 and report.infer_ms > 0 and report.peak_gflops > 0
    assert sum(o.share for o in report.ops) == pytest.approx(1.0)
    assert [o.ms for o in report.ops] == sorted((o.ms for o in report.ops), reverse=True)
    convs = [o for o in report.ops if "conv" in o.op.lower()]
    assert convs and all(o.gflop and o.gflop > 0 and o.gflops for o in convs)
    assert {e.run for e in report.events} == {0, 1, 2}
    text = report.table(top=3)
    assert "GFLOP/s" in text and "by op type" in text and convs[0].op in text


@pytest.mark.parametrize("backend", PROFILED)
def test_chrome_trace_has_one_complete_event_per_kernel_run(backend, artifacts, tmp_path):
    engine = ek.load(artifacts(backend))  # an Engine works as well as a path
    report = ek.profile(engine, feeds=CASES["cnn"].feeds(2), runs=2, warmup=0)
    trace = json.loads(report.write_trace(tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    assert len(events) == len(report.events) and all(e["ph"] == "X" for e in events)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    assert trace["otherData"]["backend"] == backend


def test_unsupported_backend_error_names_the_backends_that_profile(mlp_path):
    if not backends.availability("xla").available:
        pytest.skip("xla is not installed")
    engine = ek.build(mlp_path, backend="xla", shapes={"x": [(1, 16), (4, 16), (8, 16)]})
    with pytest.raises(
        ek.UsageError, match="not supported by the xla backend.*onnxruntime.*openvino"
    ):
        ek.profile(engine)
    assert {"onnxruntime", "openvino"} <= set(supported())


def test_engine_without_an_artifact_and_bad_runs_are_usage_errors(artifacts):
    plain = ek.Engine([ek.TensorSpec("x", "float32", ("batch", 16))], [])
    with pytest.raises(ek.UsageError, match="no artifact"):
        ek.profile(plain)
    with pytest.raises(ek.UsageError, match="runs=0"):
        ek.profile(artifacts("onnxruntime"), runs=0)
    with pytest.raises(ek.EngineInputError, match="dtype"):
        ek.profile(artifacts("onnxruntime"), feeds={"x": np.zeros((2, 3, 16, 16))})


def test_matmul_peak_is_measured():
    assert matmul_peak(n=256, repeats=2) > 0.1


def test_cli_profile_prints_table_json_and_writes_trace(artifacts, tmp_path):
    path = artifacts("onnxruntime")
    run = [sys.executable, "-m", "enginekit", "profile", str(path), "--runs", "2"]
    table = subprocess.run([*run, "--top", "2", "--trace", str(tmp_path / "t.json")],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "op time" in table.stdout and "trace written to" in table.stdout
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    data = json.loads(
        subprocess.run(
            [*run, "--batch", "3", "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert data["shapes"] == {"x": [3, 3, 16, 16]} and data["ops"][0]["share"] > 0
    bad = subprocess.run([*run, "--top", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--top 0" in bad.stderr
