"""Batcher: many small requests from threads or asyncio, one engine, full batches.

Threads: one scheduler, which watches the delay windows and deadlines (it sleeps until the next
one is due, so a queued request expires on time even while the engine is busy), and ``workers``
engine threads. A worker that finishes a batch takes the next one itself when one is ready, so
under load batches follow each other without a thread switch through the scheduler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.batcher.metrics import Metrics, prometheus, snapshot
from enginekit.batcher.policy import ArrivalRate, CostModel, decide, pow2_sizes, take_size
from enginekit.batcher.queue import Group, WaitQueue
from enginekit.batcher.request import Layout, Request
from enginekit.engine import Engine
from enginekit.errors import (
    BatcherClosed,
    DeadlineExceeded,
    EngineInputError,
    QueueFull,
    UsageError,
)

log = logging.getLogger(__name__)

Batch = tuple[Group, list[Request], str]
_DEFAULT_MAX_BATCH = 32  # for engines built without profiles (any batch size)


def _engine_max_batch(engine: Engine) -> int | None:
    names = [s.name for s in engine.inputs]
    if not engine.profiles or not all(n in p for p in engine.profiles for n in names):
        return None
    return max(min(p[n].max[0] for n in names) for p in engine.profiles)


def _default_preferred(engine: Engine, max_batch: int) -> tuple[int, ...]:
    """Batch sizes the engine runs without padding waste, where it pads others (XLA buckets)."""
    backend = engine.manifest.get("backend", {})
    if backend.get("name") == "xla" and backend.get("metadata", {}).get("buckets") == "pow2":
        return pow2_sizes(max_batch)
    return ()


class Batcher:
    """Gathers single samples (or small batches) into batches for one engine.

    Args:
        engine: a loaded engine whose inputs and outputs share a symbolic batch dim.
        max_batch_size: the most rows in one batch (default: the largest batch the engine's
            profiles accept; 32 for an engine without profiles).
        max_delay_ms: the longest a request waits for others, counted from the oldest waiting
            request; the window never restarts.
        max_queue: the most requests waiting; one more raises QueueFull at submit.
        timeout_ms: default deadline of a request, from submit (None: none). A request still
            queued at its deadline fails with DeadlineExceeded.
        workers: engine threads (default 1; more only for engines that run concurrently).
        adaptive: send a batch before the window ends when waiting is not expected to pay
            (measured engine time against arrivals); False waits out every window.
        preferred_sizes: batch sizes to form when more rows wait ("auto": the engine's padding
            buckets, i.e. powers of two for an XLA engine with pow2 buckets; () for none).
        starvation_ms: a request waiting this long is served before newer higher-priority
            ones (default: 10 x max_delay_ms, at least 50 ms).
        pad_values: input name -> fill value: pad sequence dims up to a bucket so that requests
            of different lengths share batches (only for models that mask padding, e.g. with
            an attention mask; off by default). Outputs are cut back to each request's length.
        seq_buckets: lengths to pad up to (default: powers of two up to the profile's max).
        warmup: run the engine at batch 1 and at the maximum once, to seed the cost model.
        name: the ``batcher`` label in ``prometheus()`` output.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int | None = None,
        max_delay_ms: float = 2.0,
        *,
        max_queue: int = 1024,
        timeout_ms: float | None = None,
        workers: int = 1,
        adaptive: bool = True,
        preferred_sizes: Sequence[int] | str = "auto",
        starvation_ms: float | None = None,
        pad_values: Mapping[str, float] | None = None,
        seq_buckets: Sequence[int] | None = None,
        warmup: bool = False,
        name: str = "default",
    ) -> None:
        self.engine = engine
        self._layout = Layout(engine, pad_values, seq_buckets)
        limit = _engine_max_batch(engine)
        if max_batch_size is None:
            max_batch_size = limit or _DEFAULT_MAX_BATCH
        _positive("max_batch_size", max_batch_size, integer=True)
        _positive("max_queue", max_queue, integer=True)
        _positive("workers", workers, integer=True)
        if max_delay_ms < 0:
            raise UsageError(f"max_delay_ms={max_delay_ms}: expected >= 0 (0 sends at once)")
        if timeout_ms is not None:
            _positive("timeout_ms", timeout_ms)
        self.max_batch_size = int(max_batch_size)
        self.max_delay = max_delay_ms / 1e3
        self.max_queue = int(max_queue)
        self.timeout = timeout_ms / 1e3 if timeout_ms is not None else None
        self.starve = (
            starvation_ms / 1e3 if starvation_ms is not None else max(10 * self.max_delay, 0.05)
        )
        if isinstance(preferred_sizes, str):
            if preferred_sizes != "auto":
                raise UsageError(
                    f"preferred_sizes={preferred_sizes!r}: expected 'auto' or a list of sizes"
                )
            preferred: tuple[int, ...] = _default_preferred(engine, self.max_batch_size)
        else:
            preferred = tuple(sorted({int(p) for p in preferred_sizes}))
            bad = [p for p in preferred if not 1 <= p <= self.max_batch_size]
            if bad:
                raise UsageError(
                    f"preferred_sizes {bad}: each must lie in 1..max_batch_size "
                    f"({self.max_batch_size})"
                )
        self.preferred = preferred
        self.name = name
        self._cost = CostModel()
        self._rate: ArrivalRate | None = ArrivalRate() if adaptive else None
        self._arrivals = ArrivalRate()  # for stats even when not adaptive
        self._queue = WaitQueue()
        self._metrics = Metrics()
        self._cv = threading.Condition(threading.Lock())
        self._handoff: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._workers = int(workers)
        self._idle = int(workers)
        self._closing = False
        self._drain = True
        self._wake = math.inf  # when the sleeping scheduler looks again by itself
        if warmup:
            self._warmup()
        self._threads = [
            threading.Thread(target=self._schedule, name=f"batcher-{name}-scheduler", daemon=True)
        ] + [
            threading.Thread(target=self._work, name=f"batcher-{name}-worker{i}", daemon=True)
            for i in range(self._workers)
        ]
        for t in self._threads:
            t.start()

    # -- calls -------------------------------------------------------------------------------

    def submit(
        self, sample: Any, *, priority: int = 0, timeout_ms: float | None = None
    ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Queue one sample; returns a Future of its outputs (output name -> array).

        Args:
            sample: one row (a mapping name -> array, a sequence in input order, or one array
                for a single-input model; arrays without the batch dim) or a small batch (with
                it). Results come back in the same form: rows without, batches with the dim.
            priority: higher is served first (within the starvation bound).
            timeout_ms: this request's deadline from now (default: the Batcher's timeout_ms).

        Raises:
            EngineInputError: the sample does not fit the engine (it fails alone, at once).
            QueueFull: ``max_queue`` requests are waiting already.
            BatcherClosed: close() was called.
        """
        try:
            request = self._layout.prepare(sample)
        except EngineInputError:
            with self._cv:
                self._metrics.submitted += 1
                self._metrics.outcomes["invalid"] += 1
            raise
        request.priority = int(priority)
        now = time.monotonic()
        request.arrival = now
        wait = self.timeout if timeout_ms is None else timeout_ms / 1e3
        if wait is not None:
            request.deadline = now + wait
        with self._cv:
            m = self._metrics
            m.submitted += 1
            if self._closing:
                m.outcomes["closed"] += 1
                raise BatcherClosed(
                    f"batcher {self.name!r} is closed: create a new Batcher to submit more"
                )
            q = self._queue
            if q.count >= self.max_queue and not self._purge_cancelled():
                m.outcomes["rejected"] += 1
                raise QueueFull(
                    f"batcher {self.name!r}: {q.count} requests are waiting (max_queue="
                    f"{self.max_queue}); retry later, shed load, or raise max_queue"
                )
            q.add(request)
            self._arrivals.observe(now)
            if self._rate is not None:
                self._rate.observe(now)
            # Wake the scheduler only when it has something to do: a worker is free to take
            # this request, or its deadline falls before the scheduler's next wake-up.
            if self._idle or request.deadline < self._wake:
                self._cv.notify()
        return request.future

    def infer(
        self, sample: Any, *, priority: int = 0, timeout_ms: float | None = None
    ) -> dict[str, np.ndarray]:
        """Submit one sample and block until its outputs are ready (see :meth:`submit`)."""
        return self.submit(sample, priority=priority, timeout_ms=timeout_ms).result()

    async def infer_async(
        self, sample: Any, *, priority: int = 0, timeout_ms: float | None = None
    ) -> dict[str, np.ndarray]:
        """``await`` one sample's outputs from asyncio code (see :meth:`submit`).

        Cancelling the awaiting task cancels the request if it has not started running.
        """
        future = self.submit(sample, priority=priority, timeout_ms=timeout_ms)
        return await asyncio.wrap_future(future)

    # -- metrics -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Queue depth, counts by outcome, batch-size histogram, timing percentiles (ms)."""
        with self._cv:
            now = time.monotonic()
            gap = self._arrivals.expected_gap(now)
            stats = snapshot(
                self._metrics,
                queue_depth=self._queue.count,
                queue_rows=self._queue.rows,
                running_batches=self._workers - self._idle,
                arrival_rate_per_s=0.0 if math.isinf(gap) or gap <= 0 else 1.0 / gap,
                model={
                    "fixed_ms": self._cost.fixed * 1e3,
                    "per_row_ms": self._cost.per_row * 1e3,
                    "runs": self._cost.runs,
                },
            )
        return stats

    def prometheus(self) -> str:
        """:meth:`stats` in Prometheus text exposition format, for a /metrics endpoint."""
        return prometheus(self.stats(), self.name, self.max_batch_size)

    # -- closing -------------------------------------------------------------------------------

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests and stop every thread of this batcher.

        Args:
            drain: True finishes every accepted request first; False fails those still queued
                with BatcherClosed (batches already in the engine finish).
            timeout: seconds to wait for the threads (None: as long as it takes).
        """
        with self._cv:
            self._closing = True
            self._drain = self._drain and drain
            dropped = [] if drain else self._queue.take_all()
            self._metrics.outcomes["closed"] += len(dropped)
            self._cv.notify_all()
        error = BatcherClosed(f"batcher {self.name!r} closed without draining before this ran")
        for r in dropped:
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(error)
        if threading.current_thread() in self._threads:
            return  # called from a result callback: the threads end once this one returns
        for t in self._threads:
            t.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closing

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<Batcher {self.name!r} max_batch_size={self.max_batch_size} "
            f"max_delay_ms={self.max_delay * 1e3:g} workers={self._workers}>"
        )

    # -- scheduling (under the lock) -------------------------------------------------------------

    def _purge_cancelled(self) -> int:
        dropped = self._queue.purge_cancelled()
        self._metrics.outcomes["cancelled"] += dropped
        return dropped

    def _expire(self, now: float) -> list[Request]:
        expired = self._queue.expire(now)
        self._metrics.outcomes["expired"] += len(expired)
        return expired

    def _ready(self, now: float) -> tuple[Batch | None, float]:
        """The batch to send now, if any, and otherwise when to look again."""
        best: tuple[Any, ...] | None = None
        wake = self._queue.next_deadline()
        draining = self._closing
        for group in self._queue.groups.values():
            oldest = group.oldest()
            if oldest is None:
                continue
            if draining:
                reason = "close"
            else:
                d = decide(
                    group.rows,
                    self.max_batch_size,
                    oldest.arrival,
                    now,
                    self.max_delay,
                    self._rate,
                    self._cost,
                )
                if not d.send:
                    wake = min(wake, d.recheck_at)
                    continue
                reason = d.reason
            rank = group.rank(now, self.starve)
            if best is None or rank > best[0]:
                best = (rank, group, reason)
        if best is None:
            return None, wake
        _, group, reason = best
        size = take_size(group.rows, self.max_batch_size, self.preferred, reason)
        taken = self._queue.take(group, size, now, self.starve)
        return (group, taken, reason), now

    def _admit(self, batch: Batch, now: float) -> Batch | None:
        """Mark the batch's futures running; drop cancelled ones. None if nothing is left."""
        group, taken, reason = batch
        live = [r for r in taken if r.future.set_running_or_notify_cancel()]
        m = self._metrics
        m.outcomes["cancelled"] += len(taken) - len(live)
        if not live:
            return None
        for r in live:
            m.add("queue_wait", now - r.arrival)
        m.reasons[reason] += 1
        return group, live, reason

    def _expired_error(self, r: Request) -> DeadlineExceeded:
        waited = (time.monotonic() - r.arrival) * 1e3
        return DeadlineExceeded(
            f"batcher {self.name!r}: request waited {waited:.1f} ms in the queue, past its "
            f"{(r.deadline - r.arrival) * 1e3:g} ms deadline; the engine is overloaded — add "
            "capacity, lower the load, or allow a longer timeout_ms"
        )

    def _next(self, now: float) -> tuple[Batch | None, list[Request]]:
        """Expire what is due, then take the next ready batch (under the lock)."""
        expired = self._expire(now)
        while True:
            ready, _ = self._ready(now)
            if ready is None:
                return None, expired
            admitted = self._admit(ready, now)
            if admitted is not None:
                return admitted, expired

    def _fail_expired(self, expired: list[Request]) -> None:
        for r in expired:
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(self._expired_error(r))

    def _schedule(self) -> None:
        """The scheduler thread: expire deadlines on time, hand ready batches to idle workers."""
        cv = self._cv
        while True:
            with cv:
                while True:
                    now = time.monotonic()
                    expired = self._expire(now)
                    if expired:
                        break
                    if self._closing and not self._queue.count:
                        if self._idle == self._workers:
                            for _ in range(self._workers):
                                self._handoff.put(None)
                            return
                        cv.wait()
                        continue
                    wake = self._queue.next_deadline()
                    if self._idle:
                        batch, wake = self._ready(now)
                        if batch is not None:
                            admitted = self._admit(batch, now)
                            if admitted is not None:
                                self._idle -= 1
                                self._handoff.put(admitted)
                            continue
                        wake = min(wake, self._queue.next_deadline())
                    self._wake = wake
                    cv.wait(None if math.isinf(wake) else max(wake - now, 0.0))
                    self._wake = -math.inf  # awake: submit need not notify for deadlines
            self._fail_expired(expired)

    # -- the engine threads --------------------------------------------------------------------

    def _work(self) -> None:
        """An engine thread: run a batch, deliver it, take the next ready one or go idle."""
        layout, engine, cv, m = self._layout, self.engine, self._cv, self._metrics
        while True:
            batch = self._handoff.get()
            if batch is None:  # the scheduler's stop signal
                return
            while batch is not None:
                _, requests, _ = batch
                rows = sum(r.rows for r in requests)
                results: list[dict[str, np.ndarray]] | None = None
                error: BaseException | None = None
                start = time.perf_counter()
                try:
                    outputs = engine.infer(layout.stack(requests))
                    elapsed = time.perf_counter() - start
                    results = layout.split(outputs, requests)
                except BaseException as exc:  # handed to the batch's futures
                    elapsed = time.perf_counter() - start
                    error = exc
                    log.warning("batcher %r: a batch of %d rows failed: %r", self.name, rows, exc)
                with cv:
                    m.batches += 1
                    m.batch_rows[rows] += 1
                    m.add("engine", elapsed)
                    if error is None:
                        self._cost.observe(rows, elapsed)
                        m.outcomes["completed"] += len(requests)
                    else:
                        m.outcomes["failed"] += len(requests)
                    now = time.monotonic()
                    for r in requests:
                        m.add("latency", now - r.arrival)
                    batch, expired = self._next(now) if self._drain else (None, [])
                    if batch is None:
                        self._idle += 1
                        cv.notify()
                if results is not None:
                    for r, res in zip(requests, results):
                        r.future.set_result(res)
                else:
                    for r in requests:
                        r.future.set_exception(error)
                self._fail_expired(expired)

    def _warmup(self) -> None:
        feeds_for = {}
        profile = self.engine.profiles[0] if self.engine.profiles else {}
        for s in self.engine.inputs:
            if s.name in profile:
                dims = profile[s.name].opt[1:]
            elif all(isinstance(d, int) for d in s.shape[1:]):
                dims = tuple(int(d) for d in s.shape[1:])
            else:
                raise UsageError(
                    f"warmup: input {s.name!r} has free dims {s.shape} and the engine no "
                    "profile to pick sizes from; submit a few requests instead"
                )
            feeds_for[s.name] = (np.dtype(s.dtype), dims)
        for rows in (1, self.max_batch_size, 1, self.max_batch_size):
            feeds = {n: np.zeros((rows, *dims), dt) for n, (dt, dims) in feeds_for.items()}
            start = time.perf_counter()
            self.engine.infer(feeds)
            self._cost.observe(rows, time.perf_counter() - start)


def _positive(name: str, value: float, integer: bool = False) -> None:
    if (integer and (isinstance(value, bool) or not isinstance(value, int))) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise UsageError(f"{name}={value!r}: expected {kind}")
