"""Batcher under load and faults: backpressure, deadlines, priorities, cancellation, bad
requests, a failing engine, closing with and without draining, and no thread left behind."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import enginekit as ek

from .batcher_engines import POISON, Held, build, rows


@pytest.fixture
def held(cnn):
    engine = Held(cnn)
    yield engine
    engine.gate.set()


def running(batcher: ek.Batcher, held: Held, x: np.ndarray):
    """Submit ``x`` and return its Future once its batch is inside the (held) engine."""
    held.hold()
    future = batcher.submit(x)
    assert held.started.wait(10)
    return future


def batcher_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("batcher-")}


def test_queue_full_at_submit_is_typed_and_counted(held):
    x = rows(5)
    with ek.Batcher(held, max_queue=3, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        waiting = [batcher.submit(x[i]) for i in (1, 2, 3)]
        with pytest.raises(ek.QueueFull, match="max_queue=3"):
            batcher.submit(x[4])
        assert batcher.stats()["queue_depth"] == 3
        held.gate.set()
        for f in [blocker, *waiting]:
            f.result(timeout=10)
        assert batcher.submit(x[4]).result(timeout=10)["output"].shape == (10,)
        stats = batcher.stats()
    assert stats["rejected"] == 1 and stats["completed"] == 5


def test_deadline_expires_queued_request_while_the_engine_is_busy(held):
    x = rows(3)
    with ek.Batcher(held, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        late = batcher.submit(x[1], timeout_ms=30)
        patient = batcher.submit(x[2])
        error = late.exception(timeout=10)
        assert isinstance(error, ek.DeadlineExceeded) and isinstance(error, TimeoutError)
        assert "30 ms deadline" in str(error)
        assert not held.gate.is_set()  # expired while the running batch was still held
        held.gate.set()
        blocker.result(timeout=10)
        patient.result(timeout=10)
        stats = batcher.stats()
    assert stats["expired"] == 1 and stats["completed"] == 2
    assert all(1001 not in b for b in held.batches)  # never ran


def test_default_timeout_applies_to_every_request(held):
    x = rows(2)
    with ek.Batcher(held, timeout_ms=20, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        late = batcher.submit(x[1])
        with pytest.raises(ek.DeadlineExceeded):
            late.result(timeout=10)
        held.gate.set()
        blocker.result(timeout=10)


def test_higher_priority_is_served_first(held):
    x = rows(9)
    with ek.Batcher(held, max_batch_size=4, max_delay_ms=1.0, starvation_ms=10_000) as batcher:
        blocker = running(batcher, held, x[0])
        low = [batcher.submit(x[i], priority=0) for i in (1, 2, 3, 4)]
        high = [batcher.submit(x[i], priority=5) for i in (5, 6, 7, 8)]
        held.gate.set()
        for f in [blocker, *low, *high]:
            f.result(timeout=10)
    assert held.batches[1:3] == [[5.0, 6.0, 7.0, 8.0], [1.0, 2.0, 3.0, 4.0]]


def test_a_starved_low_priority_request_goes_before_newer_high_ones(held):
    x = rows(9)
    with ek.Batcher(held, max_batch_size=4, max_delay_ms=1.0, starvation_ms=20) as batcher:
        blocker = running(batcher, held, x[0])
        old_low = batcher.submit(x[1], priority=0)
        time.sleep(0.06)  # past the starvation bound
        high = [batcher.submit(x[i], priority=9) for i in range(2, 9)]
        held.gate.set()
        for f in [blocker, old_low, *high]:
            f.result(timeout=10)
    assert held.batches[1][0] == 1.0


def test_cancelled_future_never_runs_and_frees_its_slot(held):
    x = rows(4)
    with ek.Batcher(held, max_queue=2, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        gone = batcher.submit(x[1])
        kept = batcher.submit(x[2])
        assert gone.cancel()
        third = batcher.submit(x[3])  # the cancelled request's slot is free again
        held.gate.set()
        for f in (blocker, kept, third):
            f.result(timeout=10)
        stats = batcher.stats()
    assert gone.cancelled() and all(1.0 not in b for b in held.batches)
    assert stats["cancelled"] == 1 and stats["completed"] == 3


def test_cancelling_an_awaiting_task_cancels_the_request(held):
    x = rows(2)

    async def main(batcher: ek.Batcher) -> None:
        task = asyncio.ensure_future(batcher.infer_async(x[1]))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with ek.Batcher(held, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        asyncio.run(main(batcher))
        held.gate.set()
        blocker.result(timeout=10)
        batcher.infer(x[0])  # the batcher goes on
        stats = batcher.stats()
    assert all(1.0 not in b for b in held.batches) and stats["cancelled"] == 1


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.zeros((3, 16, 16), np.float64), "dtype float32, got float64"),
        (np.zeros((16, 16), np.float32), "one row of rank 3"),
        (np.zeros((3, 15, 16), np.float32), "dim 2 must be 16"),
        ({"X": np.zeros((3, 16, 16), np.float32)}, "did you mean 'x'"),
        (np.zeros((0, 3, 16, 16), np.float32), "0 rows"),
    ],
)
def test_a_bad_request_fails_alone_at_submit(cnn, bad, message):
    x = rows(4)
    with ek.Batcher(cnn, max_delay_ms=20.0, adaptive=False) as batcher:
        good = [batcher.submit(x[i]) for i in range(4)]
        with pytest.raises(ek.EngineInputError, match=message):
            batcher.submit(bad)
        want = cnn.infer(x)["output"]
        for i, f in enumerate(good):
            np.testing.assert_allclose(f.result(timeout=10)["output"], want[i], atol=1e-5)
        stats = batcher.stats()
    assert stats["invalid"] == 1 and stats["completed"] == 4


def test_sequence_length_outside_the_profile_is_refused_at_submit(onnx_model):
    engine = build(onnx_model, "transformer")
    with ek.Batcher(engine) as batcher:
        ids, mask = np.zeros(20, np.int64), np.ones(20, np.float32)
        with pytest.raises(ek.EngineInputError, match="'ids' dim 1 is 20, built for 2..12"):
            batcher.submit({"ids": ids, "mask": mask})
        with pytest.raises(ek.EngineInputError, match="share dim 'seq' but differ"):
            batcher.submit({"ids": ids[:6], "mask": mask[:5]})


def test_engine_exception_fails_only_that_batch(held):
    x = rows(5)
    poisoned = x[1].copy()
    poisoned[0, 0, 0] = POISON
    with ek.Batcher(held, max_delay_ms=1.0) as batcher:
        blocker = running(batcher, held, x[0])
        same_batch = [batcher.submit(poisoned), batcher.submit(x[2])]
        held.gate.set()
        blocker.result(timeout=10)
        for f in same_batch:
            with pytest.raises(RuntimeError, match="poisoned row"):
                f.result(timeout=10)
        after = [batcher.submit(x[i]) for i in (3, 4)]
        for f in after:
            assert f.result(timeout=10)["output"].shape == (10,)
        stats = batcher.stats()
    assert stats["failed"] == 2 and stats["completed"] == 3


def test_close_with_drain_finishes_every_accepted_request(held):
    x = rows(6)
    before = batcher_threads()
    batcher = ek.Batcher(held, max_batch_size=2, max_delay_ms=50.0)
    blocker = running(batcher, held, x[0])
    queued = [batcher.submit(x[i]) for i in range(1, 6)]
    closer = threading.Thread(target=batcher.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # waits for the held batch and the queue
    with pytest.raises(ek.BatcherClosed):
        batcher.submit(x[0])
    held.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    for f in [blocker, *queued]:
        assert f.result(timeout=0)["output"].shape == (10,)
    assert batcher_threads() == before


def test_close_without_drain_fails_queued_requests_at_once(held):
    x = rows(6)
    before = batcher_threads()
    batcher = ek.Batcher(held, max_delay_ms=1.0)
    blocker = running(batcher, held, x[0])
    queued = [batcher.submit(x[i]) for i in range(1, 6)]
    closer = threading.Thread(target=batcher.close, kwargs={"drain": False})
    closer.start()
    for f in queued:
        assert isinstance(f.exception(timeout=10), ek.BatcherClosed)
    assert not held.gate.is_set()  # failed while the running batch was still held
    held.gate.set()
    closer.join(10)
    assert blocker.result(timeout=0)["output"].shape == (10,)  # already running: finished
    assert batcher_threads() == before
    assert batcher.stats()["closed"] == 5


def test_no_thread_is_left_after_close(cnn):
    before = set(threading.enumerate())
    for workers in (1, 3):
        with ek.Batcher(cnn, workers=workers) as batcher:
            assert len(batcher_threads()) == workers + 1  # and the helper
            batcher.infer(rows(1)[0])
    batcher = ek.Batcher(cnn)
    batcher.close()
    batcher.close()  # twice is fine
    assert set(threading.enumerate()) == before


def test_several_workers_run_batches_concurrently(held):
    x = rows(8)
    with ek.Batcher(held, workers=2, max_batch_size=2, max_delay_ms=1.0) as batcher:
        held.hold()
        futures = [batcher.submit(x[i]) for i in range(4)]
        deadline = time.monotonic() + 10
        while len(held.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(held.batches) == 2  # two batches inside the engine at once
        held.gate.set()
        for f in futures:
            f.result(timeout=10)


def test_bad_arguments_are_usage_errors(cnn):
    with pytest.raises(ek.UsageError, match="max_batch_size=0"):
        ek.Batcher(cnn, max_batch_size=0)
    with pytest.raises(ek.UsageError, match="preferred_sizes"):
        ek.Batcher(cnn, preferred_sizes=(16,))
    with pytest.raises(ek.UsageError, match="workers"):
        ek.Batcher(cnn, workers=0)


def test_close_from_a_result_callback_does_not_deadlock(cnn):
    before = batcher_threads()
    batcher = ek.Batcher(cnn, max_delay_ms=1.0)
    future = batcher.submit(rows(1)[0])
    future.add_done_callback(lambda _f: batcher.close())
    future.result(timeout=10)
    deadline = time.monotonic() + 10
    while batcher_threads() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.closed and batcher_threads() == before
