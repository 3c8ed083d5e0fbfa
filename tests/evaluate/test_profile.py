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
from enginekit.evaluate.profile import _ort_matmul, matmul_peak, matmul_rates, supported

SHAPES = CASES["cnn"].shapes
PROFILED = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not backends.availability(name).available, reason=f"{name} is not installed"
        ),
    )
    for name in ("onnxruntime", "openvino", "tvm", "xla")
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


def test_backend_without_a_profiler_is_a_usage_error_naming_those_with_one(monkeypatch, mlp_path):
    # scaled_weight (tests/scaled_weight_backend.py) wraps ONNX Runtime and defines no hook
    monkeypatch.setitem(backends._BUILTIN, "scaled_weight", "scaled_weight_backend")
    engine = ek.build(
        mlp_path, backend="scaled_weight", shapes={"x": [(1, 16), (4, 16), (8, 16)]},
        verify=False,
    )  # fmt: skip
    with pytest.raises(
        ek.UsageError, match="not supported by the scaled_weight backend.*onnxruntime.*openvino"
    ):
        ek.profile(engine)
    assert {"onnxruntime", "openvino", "tvm", "xla"} <= set(supported())


def test_tvm_kernel_flops_read_the_weight_layout_from_the_shapes():
    from enginekit.backends.tvm.profiler import _op_type, kernel_flops

    nhwc = [(4, 16, 16, 3), (3, 3, 3, 8), (4, 14, 14, 8)]  # HWIO weight
    nchw = [(4, 3, 16, 16), (8, 3, 3, 3), (4, 8, 14, 14)]  # OIHW weight
    assert kernel_flops("fused_conv2d_relu", nhwc) == 2 * 4 * 14 * 14 * 8 * 27
    assert kernel_flops("conv2d1", nchw) == kernel_flops("fused_conv2d_relu", nhwc)
    assert kernel_flops("fused_matmul_add", [(4, 1568), (1568, 10), (10,), (4, 10)]) == (
        2 * 4 * 10 * 1568
    )
    assert kernel_flops("transpose", [(4, 3), (3, 4)]) is None
    assert [_op_type(s) for s in ("fused_conv2d_add_relu", "transpose1", "matmul")] == [
        "conv2d", "transpose", "matmul",
    ]  # fmt: skip


def test_xla_hlo_flops_count_convolutions_dots_and_the_fusions_calling_them():
    from enginekit.backends.xla.profiler import hlo_flops

    text = """HloModule jit_call

%fused_computation (param_0: f32[4,8], param_1: f32[8,10]) -> f32[4,10] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,10]{1,0} parameter(1)
  ROOT %dot.2 = f32[4,10]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.1 (w: f32[3,3,3,8], x: f32[4,16,16,3], m: f32[8,10]) -> f32[4,10] {
  %w = f32[3,3,3,8]{3,2,1,0} parameter(0)
  %x = f32[4,16,16,3]{3,2,1,0} parameter(1)
  %m = f32[8,10]{1,0} parameter(2)
  %conv.1 = f32[4,14,14,8]{3,2,1,0} convolution(%x, %w), window={size=3x3}, dim_labels=b01f_01io->b01f
  %r = f32[4,8]{1,0} reduce(%conv.1), dimensions={1,2}
  ROOT %dot_fusion = f32[4,10]{1,0} fusion(%r, %m), kind=kOutput, calls=%fused_computation
}
"""
    flops = hlo_flops(text)
    assert flops["conv.1"] == 2 * 4 * 14 * 14 * 8 * 27
    assert flops["dot_fusion"] == flops["dot.2"] == 2 * 4 * 10 * 8
    assert "r" not in flops


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


def test_matmul_peak_is_the_best_of_numpy_and_onnx_runtime():
    # numpy's BLAS does not reach every host's peak (on a Zen 5-class EPYC it read ~half of
    # what ONNX Runtime's MLAS ran): the peak takes the best of both GEMM libraries.
    rates = matmul_rates(n=128, repeats=2)
    assert set(rates) == {"numpy", "onnxruntime"} and min(rates.values()) > 0.1
    a, b = (np.random.default_rng(i).standard_normal((64, 64), dtype=np.float32) for i in (0, 1))
    np.testing.assert_allclose(_ort_matmul(64)(a, b), a @ b, rtol=1e-4, atol=1e-4)


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
