"""Batcher: per-request results equal unbatched Engine.infer, under concurrency, in every form
a sample can take; the delay window; sequence groups and padding; asyncio and threads together."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time

import numpy as np
import pytest
from models import CASES

import enginekit as ek

from .batcher_engines import Held, build, rows


@pytest.fixture(scope="module")
def two(onnx_model):
    engine = build(onnx_model, "two_input")
    yield engine
    engine.close()


def close_to(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=atol)


def test_sixteen_submitters_get_their_own_rows_in_order(cnn):
    held = Held(cnn)
    per_thread = 24
    samples = {t: rows(per_thread, seed=t + 1) for t in range(16)}
    extra = {t: rows(3, seed=t + 100) for t in range(16)}  # small batches, marked apart
    barrier = threading.Barrier(16)

    def submit_all(t: int) -> list:
        barrier.wait()
        futures = []
        for i, x in enumerate(samples[t]):
            # Single rows, and now and then a small batch of up to 3 rows.
            sample = x if i % 5 else extra[t][: 1 + t % 3]
            futures.append((sample, batcher.submit(sample)))
        return [(sample, f.result(timeout=30)) for sample, f in futures]

    with ek.Batcher(held, max_delay_ms=3.0) as batcher:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(submit_all, range(16)))
        stats = batcher.stats()
    for got in results:
        for sample, out in got:
            if sample.ndim == 3:
                want = {k: v[0] for k, v in cnn.infer(sample[None]).items()}
            else:
                want = cnn.infer(sample)
            close_to(out, want)
    assert stats["completed"] == 16 * per_thread and stats["failed"] == 0
    assert stats["mean_batch_size"] > 1, stats["batch_size"]  # it did batch
    # Within one submitter and one priority, requests run in the order they were submitted.
    served = [m for batch in held.batches for m in batch]
    for t in range(16):
        mine = [m for m in served if 1000 * (t + 1) <= m < 1000 * (t + 2)]
        assert mine == sorted(mine)


def test_row_sample_forms_mapping_sequence_and_array(two):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(8).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    want = {k: v[0] for k, v in two.infer({"a": a[None], "b": b[None]}).items()}
    with ek.Batcher(two, max_delay_ms=1.0) as batcher:
        close_to(batcher.infer({"a": a, "b": b}), want)
        close_to(batcher.infer([a, b]), want)
        batch = batcher.infer({"a": np.stack([a, a]), "b": np.stack([b, b])})
    assert [v.shape for v in batch.values()] == [(2, 6), (2, 1)]


def test_request_larger_than_max_batch_runs_alone(cnn):
    x = rows(11)
    with ek.Batcher(cnn, max_batch_size=4, max_delay_ms=1.0) as batcher:
        close_to(batcher.infer(x), cnn.infer(x))


def test_sequence_lengths_batch_separately_and_match_unbatched(encoder):
    case = CASES["transformer"]
    samples = [case.feeds(1, seed=i, seq=(4, 6, 8)[i % 3]) for i in range(18)]
    with ek.Batcher(encoder, max_delay_ms=20.0, adaptive=False) as batcher:
        futures = [batcher.submit({k: v[0] for k, v in s.items()}) for s in samples]
        outs = [f.result(timeout=30) for f in futures]
        stats = batcher.stats()
    for s, out in zip(samples, outs):
        close_to(out, {k: v[0] for k, v in encoder.infer(s).items()}, atol=1e-4)
    assert stats["batches"] <= 9 and stats["mean_batch_size"] >= 2


def test_padding_to_a_bucket_mixes_lengths_and_cuts_outputs_back(encoder):
    case = CASES["transformer"]
    samples = [case.feeds(1, seed=i, seq=(3, 5, 7, 8)[i % 4]) for i in range(16)]
    with ek.Batcher(
        encoder, max_delay_ms=30.0, adaptive=False, pad_values={"ids": 0, "mask": 0.0}
    ) as batcher:
        futures = [batcher.submit({k: v[0] for k, v in s.items()}) for s in samples]
        outs = [f.result(timeout=30) for f in futures]
        stats = batcher.stats()
    for s, out in zip(samples, outs):
        want = {k: v[0] for k, v in encoder.infer(s).items()}
        close_to(out, want, atol=1e-4)  # padded keys are masked: same values, own length
    # Lengths 5, 7 and 8 all pad to the bucket 8 and share batches.
    assert stats["batches"] < 16 and max(stats["batch_size"]) >= 8


def test_padding_needs_a_value_for_every_input_sharing_the_dim(encoder):
    with pytest.raises(ek.UsageError, match="'mask'.*pad value"):
        ek.Batcher(encoder, pad_values={"ids": 0})
    with pytest.raises(ek.UsageError, match="did you mean 'mask'"):
        ek.Batcher(encoder, pad_values={"ids": 0, "masks": 0})


def test_lone_request_is_sent_at_the_window_end_without_adaptive(cnn):
    x = rows(1)[0]
    with ek.Batcher(cnn, max_delay_ms=40.0, adaptive=False) as batcher:
        batcher.infer(x)  # warm
        start = time.perf_counter()
        batcher.infer(x)
        waited = time.perf_counter() - start
        batch_ms = batcher.stats()["engine_ms"]["p99"]
    assert waited >= 0.040
    assert waited <= 0.040 + 20 * batch_ms / 1e3 + 0.25  # generous: this machine is shared


def test_adaptive_sends_a_lone_request_without_waiting_out_the_window(cnn):
    x = rows(1)[0]
    with ek.Batcher(cnn, max_delay_ms=500.0) as batcher:
        latencies = []
        for _ in range(5):
            start = time.perf_counter()
            batcher.infer(x)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)  # low load: the next request is far off
    assert min(latencies) < 0.25  # well under the 500 ms window


def test_window_starts_at_the_oldest_request_and_never_restarts(cnn):
    x = rows(2)
    with ek.Batcher(cnn, max_delay_ms=150.0, adaptive=False) as batcher:
        start = time.perf_counter()
        first = batcher.submit(x[0])
        time.sleep(0.08)
        second = batcher.submit(x[1])
        first.result(timeout=10)
        done_first = time.perf_counter() - start
        second.result(timeout=10)
        stats = batcher.stats()
    assert stats["batch_size"] == {2: 1}  # both in one batch, sent once the first's window ended
    assert done_first < 0.15 + 0.08 + 0.25  # not 150 ms after the second request


def test_asyncio_and_thread_callers_together(cnn):
    x = rows(40)
    want = cnn.infer(x)["output"]

    async def main(batcher: ek.Batcher) -> list:
        return await asyncio.gather(*(batcher.infer_async(x[i]) for i in range(20)))

    with ek.Batcher(cnn, max_delay_ms=5.0) as batcher:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            threaded = [pool.submit(batcher.infer, x[i]) for i in range(20, 40)]
            async_out = asyncio.run(main(batcher))
            thread_out = [f.result(timeout=30) for f in threaded]
    for i, out in enumerate(async_out + thread_out):
        np.testing.assert_allclose(out["output"], want[i], rtol=1e-5, atol=1e-5)


def test_preferred_sizes_default_to_xla_pow2_buckets(cnn):
    manifest = {"backend": {"name": "xla", "metadata": {"buckets": "pow2"}}}
    with ek.Batcher(Held(cnn, manifest)) as batcher:
        assert batcher.max_batch_size == 8 and batcher.preferred == (1, 2, 4, 8)
    with ek.Batcher(cnn) as batcher:
        assert batcher.preferred == ()


def test_preferred_size_is_formed_when_more_rows_wait(cnn):
    held = Held(cnn)
    x = rows(7)
    with ek.Batcher(held, max_delay_ms=500.0, preferred_sizes=(4, 8)) as batcher:
        held.hold()
        blocker = batcher.submit(x[0])
        assert held.started.wait(10)
        futures = [batcher.submit(x[i]) for i in range(1, 7)]
        held.gate.set()
        for f in [blocker, *futures]:
            f.result(timeout=10)
    assert [len(b) for b in held.batches][:2] == [1, 4]  # 6 waiting: a batch of 4 first


def test_a_full_batch_goes_at_once_inside_a_long_window(cnn):
    x = rows(4)
    with ek.Batcher(cnn, max_batch_size=4, max_delay_ms=60_000, adaptive=False) as batcher:
        futures = [batcher.submit(x[i]) for i in range(4)]
        for f in futures:
            f.result(timeout=20)  # not 60 s: the waiting worker is woken at the 4th row
        assert batcher.stats()["dispatch_reasons"] == {"full": 1}


class Echo(ek.Engine):
    """Returns its input as its output (a view, as an identity model may): the batcher must not
    hand out views of the buffer it collates the next batch into."""

    def __init__(self, second_call: threading.Event | None = None) -> None:
        spec = ek.TensorSpec("x", "float32", ("batch", 3))
        profile = {"x": ek.ShapeProfile((1, 3), (4, 3), (8, 3))}
        super().__init__([spec], [ek.TensorSpec("y", "float32", ("batch", 3))], [profile])
        self.calls = 0
        self.release = second_call
        self.entered = threading.Event()

    def _run(self, feeds: dict) -> dict:
        self.calls += 1
        if self.calls == 2 and self.release is not None:
            self.entered.set()
            assert self.release.wait(30)
        return {"y": feeds["x"]}


def test_outputs_that_alias_the_collated_input_are_not_overwritten():
    x = np.arange(48, dtype=np.float32).reshape(16, 3)
    with ek.Batcher(Echo(), max_batch_size=4, max_delay_ms=5_000, adaptive=False) as batcher:
        futures = [batcher.submit(row) for row in x]  # four batches through the same buffer
        got = np.stack([f.result(timeout=10)["y"] for f in futures])
        assert batcher.stats()["batches"] == 4
    np.testing.assert_array_equal(got, x)


def test_results_of_a_batch_arrive_while_the_next_batch_runs():
    release = threading.Event()
    engine = Echo(second_call=release)
    x = np.ones((8, 3), np.float32)
    with ek.Batcher(engine, max_batch_size=4, max_delay_ms=5_000, adaptive=False) as batcher:
        futures = [batcher.submit(row) for row in x]  # two full batches queued at once
        assert engine.entered.wait(10)  # the second batch is inside the engine
        try:
            for f in futures[:4]:
                assert f.result(timeout=10)["y"].shape == (3,)  # the first batch's results
            assert not any(f.done() for f in futures[4:])
        finally:
            release.set()
        for f in futures[4:]:
            f.result(timeout=10)


def test_the_next_full_batch_is_collated_while_the_engine_runs():
    release = threading.Event()
    engine = Echo(second_call=release)
    x = np.arange(36, dtype=np.float32).reshape(12, 3)
    with ek.Batcher(engine, max_batch_size=4, max_delay_ms=5_000, adaptive=False) as batcher:
        futures = [batcher.submit(row) for row in x]  # three full batches
        assert engine.entered.wait(10)  # the second is held inside the engine
        try:
            deadline = time.monotonic() + 10
            while batcher.stats()["prepared_batches"] < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert batcher.stats()["prepared_batches"] == 1  # the third, ready to go
        finally:
            release.set()
        got = np.stack([f.result(timeout=10)["y"] for f in futures])
    np.testing.assert_array_equal(got, x)  # in order, nothing overwritten


def test_a_worker_takes_the_collated_batch_without_the_lock():
    # Under overload submit() and the helper hold the lock often: a worker leaving the engine
    # must not wait for it to start the batch the helper collated meanwhile.
    release = threading.Event()
    engine = Echo(second_call=release)
    x = np.arange(72, dtype=np.float32).reshape(24, 3)  # three full batches of 8
    with ek.Batcher(engine, max_batch_size=8, max_delay_ms=5_000, adaptive=False) as batcher:
        futures = [batcher.submit(row) for row in x]
        assert engine.entered.wait(10)  # the second is held inside the engine
        deadline = time.monotonic() + 10
        while batcher.stats()["prepared_batches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        with batcher._lock:  # held by "another thread" while the second call ends
            release.set()
            deadline = time.monotonic() + 5
            while engine.calls < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert engine.calls == 3  # the third batch started with the lock still held
        got = np.stack([f.result(timeout=10)["y"] for f in futures])
    np.testing.assert_array_equal(got, x)


def test_a_dict_sample_seen_before_skips_checks_but_not_validation(two):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(8).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    want = {k: v[0] for k, v in two.infer({"a": a[None], "b": b[None]}).items()}
    with ek.Batcher(two, max_delay_ms=1.0) as batcher:
        for _ in range(2):  # the second goes through the cached signature
            close_to(batcher.infer({"a": a, "b": b}), want)
        with pytest.raises(ek.EngineInputError, match="dtype float32, got float64"):
            batcher.submit({"a": a.astype(np.float64), "b": b})
        with pytest.raises(ek.EngineInputError, match="missing input 'b'"):
            batcher.submit({"a": a, "c": b})


class Split(ek.Engine):
    """Two outputs per row (the input and its double), or ``short`` rows too few."""

    def __init__(self, short: int = 0) -> None:
        spec = ek.TensorSpec("x", "float32", ("batch", 3))
        profile = {"x": ek.ShapeProfile((1, 3), (4, 3), (8, 3))}
        outs = [
            ek.TensorSpec("y", "float32", ("batch", 3)),
            ek.TensorSpec("z", "float32", ("batch",)),
        ]
        super().__init__([spec], outs, [profile])
        self.short = short

    def _run(self, feeds: dict) -> dict:
        x = feeds["x"][: len(feeds["x"]) - self.short]
        return {"y": x.copy(), "z": 2 * x[:, 0]}


def test_each_row_gets_its_own_rows_of_every_output():
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    with ek.Batcher(Split(), max_batch_size=4, max_delay_ms=5_000, adaptive=False) as batcher:
        got = [f.result(timeout=10) for f in [batcher.submit(row) for row in x]]
    for row, out in zip(x, got):
        assert out.keys() == {"y", "z"}
        np.testing.assert_array_equal(out["y"], row)
        assert out["z"] == 2 * row[0]


def test_an_engine_returning_too_few_rows_fails_its_batch_and_leaves_no_future_hanging():
    with ek.Batcher(Split(short=1), max_batch_size=4, max_delay_ms=5_000, adaptive=False) as b:
        futures = [b.submit(row) for row in np.ones((4, 3), np.float32)]
        for f in futures:
            with pytest.raises(ek.BatcherError, match="output 'y' has 3 rows for a batch of 4"):
                f.result(timeout=10)
        assert b.stats()["failed"] == 4


class Watched(Split):
    """Records, from inside each call, when the batcher expects its engine thread back."""

    def __init__(self) -> None:
        super().__init__()
        self.batcher: ek.Batcher | None = None
        self.seen: list[float] = []

    def _run(self, feeds: dict) -> dict:
        assert self.batcher is not None
        self.seen.append(min(self.batcher._due))
        return super()._run(feeds)


def test_engine_threads_say_when_their_call_should_end_and_the_helper_yields_once_past_it():
    engine = Watched()
    with ek.Batcher(engine, max_batch_size=4, max_delay_ms=5_000, adaptive=False) as batcher:
        engine.batcher = batcher
        for f in [batcher.submit(row) for row in np.ones((8, 3), np.float32)]:
            f.result(timeout=10)
        assert len(engine.seen) == 2 and all(math.isfinite(t) for t in engine.seen)
        assert batcher._due == [math.inf] * len(batcher._due)  # nobody in the engine
        # A call past its expected end: the helper hands the interpreter lock over once.
        batcher._due[0] = time.perf_counter() - 1.0
        batcher._yield_to_engine()
        assert batcher._due[0] == math.inf
        batcher._due[0] = later = time.perf_counter() + 60.0  # not yet: left alone
        batcher._yield_to_engine()
        assert batcher._due[0] == later
        batcher._due[0] = math.inf
