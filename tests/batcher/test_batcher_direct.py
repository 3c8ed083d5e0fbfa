"""Batcher.infer on the caller's thread (DirectRun): only for a lone request to an idle worker,
in that worker's slot (never more calls at once than workers), counted, failing alone, and
waited for by close()."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from models import CASES

import enginekit as ek

from .batcher_engines import POISON, Held, rows


class Threads(Held):
    """Held, also recording the thread of every call."""

    def __init__(self, inner: ek.Engine) -> None:
        super().__init__(inner)
        self.threads: list[int] = []

    def _run(self, feeds):
        self.threads.append(threading.get_ident())
        return super()._run(feeds)


def started(engine: Held, calls: int) -> None:
    deadline = time.monotonic() + 10
    while len(engine.batches) < calls:
        assert time.monotonic() < deadline, "the engine call never started"
        time.sleep(0.001)


def test_a_lone_infer_runs_on_the_callers_thread_and_is_counted(cnn):
    engine = Threads(cnn)
    x = rows(2)
    with ek.Batcher(engine, 8, 2.0) as batcher:
        out = batcher.infer(x[0])
        # A request already batched (its own small batch) comes back in its own shape too.
        two = batcher.infer(x)
        stats = batcher.stats()
    np.testing.assert_allclose(out["output"], cnn.infer(x[:1])["output"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two["output"], cnn.infer(x)["output"], rtol=1e-5, atol=1e-6)
    assert engine.threads == [threading.get_ident()] * 2
    assert stats["dispatch_reasons"] == {"direct": 2}
    assert stats["completed"] == stats["submitted"] == stats["batches"] == 2
    assert stats["model"]["runs"] == 2  # the cost model learns from these calls too


def test_direct_false_and_waiting_requests_keep_the_engine_on_the_batchers_threads(cnn):
    engine = Threads(cnn)
    x = rows(1)[0]
    with ek.Batcher(engine, 8, 2.0, direct=False) as batcher:
        batcher.infer(x)
    with ek.Batcher(engine, 8, 30.0, adaptive=False) as batcher:
        batcher.infer(x)  # the policy waits for more rows: the worker sends it
    assert threading.get_ident() not in engine.threads


def test_a_direct_call_holds_its_workers_slot_until_it_returns(cnn):
    engine = Held(cnn)
    x = rows(2)
    with ek.Batcher(engine, 8, 2.0, standby=0) as batcher:
        engine.hold()
        result: dict = {}
        caller = threading.Thread(target=lambda: result.update(batcher.infer(x[0])))
        caller.start()
        started(engine, 1)
        assert batcher.stats()["running_batches"] == 1
        # One worker, its slot lent: a request submitted now waits for the call to end.
        later = batcher.submit(x[1])
        time.sleep(0.05)
        assert len(engine.batches) == 1 and not later.done()
        engine.gate.set()
        caller.join(10)
        assert later.result(timeout=10)["output"].shape == (10,)
    assert result["output"].shape == (10,) and len(engine.batches) == 2


def test_close_waits_for_a_direct_call_and_a_failing_one_fails_alone(cnn):
    engine = Held(cnn)
    x = rows(2)
    batcher = ek.Batcher(engine, 8, 2.0)
    engine.hold()
    result: dict = {}
    caller = threading.Thread(target=lambda: result.update(batcher.infer(x[0])))
    caller.start()
    started(engine, 1)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # drain: the accepted call finishes first
    engine.gate.set()
    closer.join(10)
    caller.join(10)
    assert not closer.is_alive() and result["output"].shape == (10,)

    bad = x.copy()
    bad[0, 0, 0, 0] = POISON
    with ek.Batcher(engine, 8, 2.0) as batcher:
        with pytest.raises(RuntimeError, match="poisoned"):
            batcher.infer(bad[0])
        assert batcher.infer(x[1])["output"].shape == (10,)
        stats = batcher.stats()
    assert stats["failed"] == 1 and stats["completed"] == 1


def test_a_padded_direct_request_is_cut_back_to_its_own_length(encoder):
    sample = CASES["transformer"].feeds(1, seed=3, seq=5)
    with ek.Batcher(encoder, pad_values={"ids": 0, "mask": 0.0}) as batcher:
        out = batcher.infer({k: v[0] for k, v in sample.items()})
        reasons = batcher.stats()["dispatch_reasons"]
    want = encoder.infer(sample)
    assert reasons == {"direct": 1}
    for k, v in want.items():
        np.testing.assert_allclose(out[k], v[0], rtol=1e-5, atol=1e-4)
