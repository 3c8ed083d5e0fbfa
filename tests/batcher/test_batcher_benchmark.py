"""benchmarks/batcher.py in its smallest form: every cell runs and reports sane numbers."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from batcher_engines import build

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "bench_batcher", ROOT / "benchmarks" / "batcher.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_every_mode_at_every_rate(script, onnx_model):
    engine = build(onnx_model, "cnn")
    rng = np.random.default_rng(0)

    def make(n):
        return rng.standard_normal((n, 3, 16, 16)).astype(np.float32)

    args = argparse.Namespace(quick=True, seconds=0.1, workers=1)
    rows = script.run_model("cnn", engine, make, 8, args)
    engine.close()
    modes = [(r["fraction"], r["mode"]) for r in rows if "fraction" in r]
    assert modes == [(f, m) for f in script.QUICK_RATES for m in ("pool", "batcher")]
    for r in rows:
        assert r["throughput"] > 0
        if "p99_ms" in r:
            assert 0 < r["p50_ms"] <= r["p99_ms"]
            assert r["ceiling"] > 0 and r["of_ceiling"] == r["throughput"] / r["ceiling"]
    assert rows[-1]["mode"] == "ceiling" and rows[-1]["generator_cpu_us"] > 0
    # The goal's ceiling ran beside the load generator, as the cell did; the cell's rate is
    # counted while the generator ran.
    top = [r for r in rows if r["mode"] == "batcher"][-1]
    assert top["ceiling_beside_generator"] > 0 and top["throughput_arriving"] > 0
    assert top["of_ceiling_beside_generator"] == (
        top["throughput_arriving"] / top["ceiling_beside_generator"]
    )
    assert 0 <= top["full_batches"] <= 1 and top["engine_ms_per_batch"] > 0
    goals = script.goals_for("cnn", rows)
    assert [g[0].split(":")[1].split()[0] for g in goals] == ["highest", "lowest-rate"]


def test_open_loop_submits_every_arrival_and_measures_from_the_schedule(script):
    import concurrent.futures

    def submit(_sample):
        done = concurrent.futures.Future()
        done.set_result(None)
        return done

    cell = script.open_loop(submit, [None] * 200, rate=20_000)
    assert cell["rejected"] == 0 and cell["throughput"] > 0
    assert cell["p50_ms"] >= 0 and cell["generator_cpu_us"] > 0


def test_noop_overhead_is_measured(script):
    wall, cpu = script.overhead(400)
    assert 0 < wall < 10_000 and 0 < cpu < 10_000
