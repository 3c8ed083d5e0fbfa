"""How many engine threads a Batcher runs: as many as calls its engine runs at once ("auto"),
and what a second one buys — a request that arrives while a batch is inside the engine runs
beside it instead of waiting it out; and standby threads, which do that only at low load."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from models import CASES

import enginekit as ek
from enginekit.batcher import defaults
from enginekit.batcher.defaults import engine_concurrency

from .batcher_engines import BLOCK, Blocking, build, ort_cpu, rows


def test_auto_follows_what_the_engine_build_says(cnn, monkeypatch):
    monkeypatch.setattr(defaults, "usable_cores", lambda: 4)
    gpu = ort_cpu(1)
    gpu["backend"]["metadata"]["providers"] = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    claims = {
        "ort 1 thread": (ort_cpu(1), 4),
        "ort 2 threads": (ort_cpu(2), 2),
        "ort 3 threads": (ort_cpu(3), 1),
        "ort default threads (all cores)": (ort_cpu(0), 1),
        "ort parallel mode": (ort_cpu(1, execution_mode="parallel"), 1),
        "ort on a GPU": (gpu, 1),
        "openvino, 3 streams": ({"backend": {"name": "openvino", "metadata": {"streams": 3}}}, 3),
        "unknown backend": ({"backend": {"name": "xla"}}, 1),
        "no manifest": ({}, 1),
        "a broken claim": (ort_cpu("many"), 1),  # type: ignore[arg-type]
    }
    for label, (manifest, expected) in claims.items():
        engine = Blocking(cnn, manifest)
        assert engine_concurrency(engine) == expected, label
        with ek.Batcher(engine, workers="auto") as batcher:
            assert batcher.workers == expected, label
            assert batcher.stats()["workers"] == expected
    with ek.Batcher(Blocking(cnn, ort_cpu(1))) as batcher:
        assert batcher.workers == 1  # the default: one batch at a time, whatever the build


def test_a_real_one_thread_build_gets_a_worker_per_core(onnx_model):
    engine = ek.build(onnx_model("cnn"), shapes=CASES["cnn"].shapes, intra_op_threads=1)
    try:
        assert engine_concurrency(engine) == defaults.usable_cores()
    finally:
        engine.close()
    engine = build(onnx_model, "cnn")
    try:
        assert engine_concurrency(engine) == 1  # ONNX Runtime's default: all cores in one call
    finally:
        engine.close()


def test_a_request_arriving_during_a_call_runs_beside_it(cnn, monkeypatch):
    monkeypatch.setattr(defaults, "usable_cores", lambda: 2)
    engine = Blocking(cnn, ort_cpu(1))
    x = rows(2)
    x[0, 0, 0, 0] = BLOCK
    with ek.Batcher(engine, max_delay_ms=1.0, workers="auto") as batcher:
        assert batcher.workers == 2
        first = batcher.submit(x[0])
        assert engine.blocked.wait(10)
        second = batcher.submit(x[1]).result(timeout=10)  # while the first is still inside
        assert not first.done()
        engine.gate.set()
        first.result(timeout=10)
    np.testing.assert_allclose(
        second["output"], cnn.infer(x[1:2])["output"][0], rtol=1e-5, atol=1e-6
    )


def test_workers_must_be_auto_or_a_positive_count(cnn):
    for bad in ("many", 0, 1.5):
        with pytest.raises(ek.UsageError, match="workers"):
            ek.Batcher(cnn, workers=bad)


class Threads(ek.Engine):
    """Runs ``inner``, recording the thread of every call."""

    def __init__(self, inner: ek.Engine) -> None:
        super().__init__(inner.inputs, inner.outputs, inner.profiles, inner.manifest)
        self.inner = inner
        self.threads: list[int] = []

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.threads.append(threading.get_ident())
        return self.inner.infer(feeds)


def test_lone_requests_stay_on_the_worker_that_ran_last(cnn):
    # Condition.notify would wake the worker idle longest, so lone requests would take turns;
    # the newest keeps them on one thread (its core's caches hold the engine's last run).
    engine = Threads(cnn)
    x = rows(6)
    with ek.Batcher(engine, workers=3, max_delay_ms=1.0) as batcher:
        for i in range(6):
            idle(batcher)
            batcher.submit(x[i]).result(timeout=10)
    assert len(set(engine.threads)) == 1, engine.threads


def idle(batcher: ek.Batcher) -> None:
    """Wait until every worker waits on the queue (none is between batches)."""
    deadline = time.monotonic() + 10
    while batcher._idle < batcher.workers and time.monotonic() < deadline:
        time.sleep(0.001)
    assert batcher._idle == batcher.workers


# -- standby threads: at low load a request arriving during a call runs beside it; asleep
# under load --------------------------------------------------------------------------------


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(defaults, "usable_cores", lambda: 2)


def test_auto_fills_the_calls_the_engine_runs_beside_the_workers(cnn, two_cores):
    claims = {
        "1-thread ort, 2 cores": (ort_cpu(1), {}, 1, 1),
        "1-thread ort, 2 workers": (ort_cpu(1), {"workers": 2}, 2, 0),
        "ort's default threads": (ort_cpu(0), {}, 1, 0),
        "openvino, 3 streams": (
            {"backend": {"name": "openvino", "metadata": {"streams": 3}}},
            {},
            1,
            2,
        ),
        "asked for none": (ort_cpu(1), {"standby": 0}, 1, 0),
        "asked for two": (ort_cpu(0), {"standby": 2}, 1, 2),
    }
    for label, (manifest, kwargs, workers, standby) in claims.items():
        with ek.Batcher(Blocking(cnn, manifest), **kwargs) as batcher:
            assert (batcher.workers, batcher.standby) == (workers, standby), label
            stats = batcher.stats()
            assert (stats["workers"], stats["standby"]) == (workers, standby), label
            assert stats["standby_batches"] == 0


def test_standby_must_be_auto_or_a_count(cnn):
    for bad in ("some", -1, 1.5, True):
        with pytest.raises(ek.UsageError, match="standby"):
            ek.Batcher(cnn, standby=bad)


@pytest.mark.parametrize("delay", [0.002, 0.0])
def test_a_lone_request_during_a_call_runs_on_a_standby_thread(cnn, two_cores, delay):
    # A 2 ms call (learned from the warmup) is worth a standby thread; the bare sub-ms CNN's
    # is not: its running call ends about as soon as a sleeping thread would wake.
    engine = Blocking(cnn, ort_cpu(1), delay=delay)
    x = rows(2)
    x[0, 0, 0, 0] = BLOCK
    with ek.Batcher(engine, max_delay_ms=1.0, warmup=True) as batcher:  # 1 worker, 1 standby
        first = batcher.submit(x[0])
        assert engine.blocked.wait(10)
        time.sleep(0.05)  # arrivals 50 ms apart: low load
        second = batcher.submit(x[1])
        if delay:
            got = second.result(timeout=10)  # while the first is still inside
            assert not first.done()
        else:
            time.sleep(0.05)
            assert not second.done()  # waits for the worker
            engine.gate.set()
            got = second.result(timeout=10)
        assert batcher.stats()["standby_batches"] == (1 if delay else 0)
        engine.gate.set()
        first.result(timeout=10)
    np.testing.assert_allclose(got["output"], cnn.infer(x[1:2])["output"][0], rtol=1e-5, atol=1e-6)


def test_standby_threads_sleep_under_load(cnn, two_cores):
    # A 20 ms engine (learned from the warmup) and requests microseconds apart: more than one
    # arrives per call, so the queued ones wait for the worker and go as one batch.
    engine = Blocking(cnn, ort_cpu(1), delay=0.02)
    x = rows(9)
    x[0, 0, 0, 0] = BLOCK
    with ek.Batcher(engine, max_delay_ms=1.0, warmup=True) as batcher:
        assert batcher.standby == 1
        first = batcher.submit(x[0])
        assert engine.blocked.wait(10)
        rest = [batcher.submit(row) for row in x[1:]]
        time.sleep(0.05)
        assert not any(f.done() for f in rest)
        engine.gate.set()
        results = [f.result(timeout=10) for f in [first, *rest]]
        stats = batcher.stats()
    assert stats["standby_batches"] == 0
    assert stats["batch_size"] == {1: 1, 8: 1}  # the blocked one, then the 8 queued behind it
    for i, r in enumerate(results):
        np.testing.assert_allclose(
            r["output"], cnn.infer(x[i : i + 1])["output"][0], rtol=1e-5, atol=1e-6
        )


def test_close_stops_standby_threads(cnn, two_cores):
    engine = Blocking(cnn, ort_cpu(1))
    engine.gate.set()
    batcher = ek.Batcher(engine)
    assert batcher.standby == 1
    batcher.infer(rows(1)[0])
    batcher.close()
    assert not [t for t in batcher._threads if t.is_alive()]
