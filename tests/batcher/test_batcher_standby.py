"""Standby engine threads: at low load a request that arrives while the worker's batch is inside
an engine that runs calls side by side runs beside it; under load standby threads stay asleep."""

from __future__ import annotations

import time

import numpy as np
import pytest
from batcher_engines import BLOCK, Blocking, ort_cpu, rows

import enginekit as ek
from enginekit.batcher import defaults


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


def test_a_lone_request_during_a_call_runs_on_a_standby_thread(cnn, two_cores):
    engine = Blocking(cnn, ort_cpu(1))
    x = rows(2)
    x[0, 0, 0, 0] = BLOCK
    with ek.Batcher(engine, max_delay_ms=1.0) as batcher:  # the defaults: 1 worker, 1 standby
        first = batcher.submit(x[0])
        assert engine.blocked.wait(10)
        time.sleep(0.05)  # arrivals 50 ms apart against a sub-ms engine: low load
        second = batcher.submit(x[1]).result(timeout=10)  # while the first is still inside
        assert not first.done()
        assert batcher.stats()["standby_batches"] == 1
        engine.gate.set()
        first.result(timeout=10)
    np.testing.assert_allclose(
        second["output"], cnn.infer(x[1:2])["output"][0], rtol=1e-5, atol=1e-6
    )


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
