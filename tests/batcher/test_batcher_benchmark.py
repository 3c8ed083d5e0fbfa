"""benchmarks/batcher.py in its smallest form: every cell runs and reports sane numbers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pytest
from script_loader import load_script

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def script():
    return load_script(ROOT / "benchmarks" / "batcher.py", "bench_batcher")


def test_quick_run_reports_every_mode_at_every_rate(script, cnn):
    engine = cnn
    rng = np.random.default_rng(0)

    def make(n):
        return rng.standard_normal((n, 3, 16, 16)).astype(np.float32)

    args = argparse.Namespace(quick=True, seconds=0.1, workers="auto", standby="auto")
    rows = script.run_model("cnn", engine, make, 8, args)
    modes = [(r["fraction"], r["mode"]) for r in rows if "fraction" in r]
    low, top = script.QUICK_RATES
    assert modes == [
        (low, "pool"),
        (low, "batcher"),
        (low, "infer"),
        (low, "infer-q"),
        (top, "pool"),
        (top, "batcher"),
    ]
    # The blocking callers at the lowest rate: lone requests run on their own threads.
    assert next(r for r in rows if r["mode"] == "infer")["reasons"].get("direct", 0) >= 1
    assert "direct" not in next(r for r in rows if r["mode"] == "infer-q")["reasons"]
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
    # The goal's ratio is the median of interleaved rounds, each against its own ceiling.
    ratios = [r["ratio"] for r in top["overload_rounds"]]
    assert len(ratios) == script.QUICK_OVERLOAD_ROUNDS
    assert top["of_ceiling_beside_generator"] == pytest.approx(sorted(ratios)[len(ratios) // 2])
    assert 0 <= top["full_batches"] <= 1 and top["engine_ms_per_batch"] > 0
    assert top["standby_batches"] <= top["standby"] * 10**6  # counted for every cell
    for thread in (top.get("engine_thread"), top.get("ceiling_engine_thread")):
        if thread is not None:  # Linux: the engine thread's time per call, accounted
            assert thread["cpu_ms"] > 0 and thread["wall_ms"] >= thread["cpu_ms"] * 0.9
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


def test_trace_tells_what_made_each_slow_request_slow(script):
    trace = script.batcher_trace
    Call = trace.Call
    # ms from 0: the cell starts at 0; every request is scheduled at its number x 10 ms.
    calls = [
        Call((0,), 0.0002, 0.0032, 1),  # alone, on time
        Call((1,), 0.0135, 0.0165, 1),  # submitted at 10.5 while nothing ran: waited 3 ms
        Call((2,), 0.0213, 0.0243, 1),  # submitted 4 ms late
        Call((3,), 0.0301, 0.0401, 1),  # alone, its engine call took 10 ms
        Call((4,), 0.0402, 0.0432, 2),  # submitted at 40.1, behind call 3 until 40.1
        Call((5,), 0.0433, 0.0463, 1),  # submitted at 41, behind call 4 until 43.2
    ]
    arrivals = np.array([0.0, 0.010, 0.017, 0.030, 0.040, 0.041])
    submitted = [0.0001, 0.0105, 0.021, 0.0300, 0.0401, 0.041]
    done = np.array([c.end + 0.0001 for c in calls])
    rows = trace.timelines(calls, 0.0, arrivals, submitted, done)
    classes = {r["request"]: r["class"] for r in rows}
    assert classes == {
        0: "other",
        1: "window",
        2: "late submit",
        3: "slow engine",
        4: "other",
        5: "queued",
    }
    assert rows[5]["behind_ms"] == pytest.approx(2.2) and rows[5]["running_at_submit"] == 1
    # With two threads, request 5 would have run beside call 4: nothing to wait behind.
    two = {r["request"]: r for r in trace.timelines(calls, 0.0, arrivals, submitted, done, 2)}
    assert two[5]["behind_ms"] == 0 and two[5]["running_at_submit"] == 1
    summary = trace.summary(rows, share=0.5)
    assert [r["request"] for r in summary["tail"]] == [3, 2, 1]  # the slowest half
    assert {c: n for c, n in summary["tail_classes"].items() if n} == {
        "slow engine": 1,
        "late submit": 1,
        "window": 1,
    }


def test_quick_run_with_trace_reports_the_lone_call_and_the_tail(script, cnn, capsys):
    engine = cnn
    rng = np.random.default_rng(0)
    args = argparse.Namespace(quick=True, seconds=0.1, workers=1, standby="auto", trace=True)
    rows = script.run_model(
        "cnn", engine, lambda n: rng.standard_normal((n, 3, 16, 16)).astype(np.float32), 8, args
    )
    low = [r for r in rows if r.get("fraction") == script.QUICK_RATES[0]]
    assert [r["mode"] for r in low] == ["pool", "batcher", "infer", "infer-q"]
    for r in low[:2]:  # the recorded cells (the blocking callers' runs on the plain engine)
        assert 0 < r["lone_batch1_ms"] <= r["lone_batch1_p99_ms"]
        assert r["trace"]["requests"] > 0
        assert sum(r["trace"]["tail_classes"].values()) == len(r["trace"]["tail"]) >= 1
    out = capsys.readouterr().out
    assert "lone batch-1 call" in out and "trace batcher" in out and "trace pool" in out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_engine_thread_accounting_splits_wall_time_per_call(script):
    import threading

    me = threading.get_native_id()
    before = script.thread_sched(me)
    end = time.thread_time() + 0.02
    while time.thread_time() < end:  # 20 ms on the CPU
        pass
    time.sleep(0.02)  # 20 ms blocked
    t = script.per_call(before, script.thread_sched(me), calls=2)
    assert t["calls"] == 2 and t["cpu_ms"] > 0  # per call: half of the window
    assert t["blocked_ms"] > 0 and t["voluntary"] >= 0.5  # the sleep blocked it
    assert abs(t["wall_ms"] - t["cpu_ms"] - t["runqueue_ms"] - t["blocked_ms"]) < 1e-6


def test_the_overload_cell_alone_counts_the_engines_own_cpu_per_full_batch(script, cnn):
    rng = np.random.default_rng(0)
    args = argparse.Namespace(quick=True, seconds=0.1, workers=1, standby="auto", rates=(1.5,))
    rows = script.run_model(
        "cnn", cnn, lambda n: rng.standard_normal((n, 3, 16, 16)).astype(np.float32), 8, args
    )
    assert [r["mode"] for r in rows] == ["pool", "batcher", "ceiling"]
    assert "lone_batch1_ms" not in rows[1]  # no low-rate cell: no recording engine, no goal
    goals = script.goals_for("cnn", rows)
    assert [g[0].split(":")[1].split()[0] for g in goals] == ["highest"]
    for thread in (rows[1].get("engine_thread"), rows[1].get("ceiling_engine_thread")):
        if thread is not None:  # Linux: the engine's own CPU inside its thread's CPU
            assert 0 < thread["engine_cpu_ms"] <= thread["cpu_ms"] * 1.05
    # InEngine times only calls of its batch size (the full batches the ceiling runs).
    timed = script.InEngine(cnn, 4)
    timed.infer(rng.standard_normal((2, 3, 16, 16)).astype(np.float32))
    assert timed.calls == 0
    timed.infer(rng.standard_normal((4, 3, 16, 16)).astype(np.float32))
    assert timed.calls == 1 and timed.per_call()["engine_cpu_ms"] >= 0
    # A window's per_call counts only the calls since its sample (the sampler's 10-90% span
    # of the cell, the span of the engine thread's own accounting); skip leaves out warm-ups.
    since = timed.totals()
    assert np.isnan(timed.per_call(since=since)["engine_cpu_ms"])  # no call in the window yet
    timed.infer(rng.standard_normal((4, 3, 16, 16)).astype(np.float32))
    assert timed.totals()[2] - since[2] == 1
    warm = script.InEngine(cnn, 4, skip=1)
    warm.infer(rng.standard_normal((4, 3, 16, 16)).astype(np.float32))
    assert warm.calls == 0 and warm.cpu == 0


def test_steal_share_is_the_stolen_part_of_all_cpu_time_between_two_readings(script):
    assert script.steal_share((10, 1000), (30, 1200)) == pytest.approx(0.1)
    assert script.steal_share(None, (30, 1200)) is None
    assert script.steal_share((30, 1200), (30, 1200)) is None
    ticks = script.cpu_ticks()
    if ticks is not None:  # Linux: stolen ticks are a part of all ticks
        assert 0 <= ticks[0] <= ticks[1]
