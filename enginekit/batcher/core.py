"""Batcher: many small requests from threads or asyncio, one engine, full batches.

Threads: ``workers`` engine threads (worker.py), ``standby`` ones and one helper. An idle worker waits on the queue itself and
is woken by submit() only when a batch could be ready (the policy says at how many rows, or at
what time, the answer flips), so a request reaches the engine with one thread switch. A worker
hands each finished batch to the helper, which splits the outputs and resolves the futures while
the worker already runs the next batch; the helper also sleeps until the next queued deadline,
so a request expires on time even while every worker is inside the engine. A standby thread
runs a batch only while every worker is inside the engine and arrivals are sparse: at low load a
request that arrives during another's call runs beside it on an engine that runs calls side by
side, instead of waiting it out; under load it stays asleep, leaving the cores to the workers and
to the Python side of submitting and resolving. A blocking infer() whose request would go out
alone at once to an idle worker runs it on the caller's thread, in that worker's slot (direct.py).
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

from enginekit.batcher.defaults import (
    DEFAULT_MAX_BATCH,
    engine_max_batch,
    positive,
    preferred_for,
    run_warmup,
    standby_for,
    workers_for,
)
from enginekit.batcher.direct import DirectRun
from enginekit.batcher.helper import HelperThread, Prepared
from enginekit.batcher.metrics import Metrics, prometheus, snapshot
from enginekit.batcher.policy import ArrivalRate, CostModel
from enginekit.batcher.queue import WaitQueue
from enginekit.batcher.request import Form, Key, Layout, Request
from enginekit.batcher.standby import StandbyThreads
from enginekit.batcher.worker import EngineThreads
from enginekit.engine import Engine
from enginekit.errors import (
    BatcherClosed,
    EngineInputError,
    QueueFull,
    UsageError,
)

log = logging.getLogger(__name__)


class Batcher(EngineThreads, HelperThread, StandbyThreads, DirectRun):
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
        workers: engine threads (default 1: one batch at a time; "auto": as many as calls
            the engine runs at once by its own build — an ONNX Runtime CPU engine with
            ``intra_op_threads=k`` gets ``cores // k``, an OpenVINO engine one per CPU stream,
            any other engine 1).
        standby: engine threads that run a request only while every worker is inside the
            engine and fewer than one request per two batch-1 calls arrives ("auto", the
            default: as many as the engine runs calls side by side beyond ``workers`` — 1 for a
            1-thread ONNX Runtime engine on 2 cores, 0 for ONNX Runtime's default build). At
            low load a request arriving during another's call then runs beside it; under load
            they stay asleep (0: never).
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
        direct: let a blocking :meth:`infer` run the engine on its caller's thread when its
            request would go out alone at once to an idle worker (nothing queued, the policy
            sends a one-row batch now): no thread hand-off either way. The call takes that
            worker's slot, so no more calls run at once than without it (False: every call
            runs on the Batcher's threads, e.g. for an engine bound to one thread).
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
        workers: int | str = 1,
        standby: int | str = "auto",
        adaptive: bool = True,
        preferred_sizes: Sequence[int] | str = "auto",
        starvation_ms: float | None = None,
        pad_values: Mapping[str, float] | None = None,
        seq_buckets: Sequence[int] | None = None,
        direct: bool = True,
        warmup: bool = False,
        name: str = "default",
    ) -> None:
        self.engine = engine
        self._layout = Layout(engine, pad_values, seq_buckets)
        if max_batch_size is None:
            max_batch_size = engine_max_batch(engine) or DEFAULT_MAX_BATCH
        positive("max_batch_size", max_batch_size, integer=True)
        positive("max_queue", max_queue, integer=True)
        workers = workers_for(engine, workers)
        standby = standby_for(engine, standby, workers)
        if max_delay_ms < 0:
            raise UsageError(f"max_delay_ms={max_delay_ms}: expected >= 0 (0 sends at once)")
        if timeout_ms is not None:
            positive("timeout_ms", timeout_ms)
        self.max_batch_size = int(max_batch_size)
        self.workers = workers
        self.standby = standby
        self.max_delay = max_delay_ms / 1e3
        self.max_queue = int(max_queue)
        self.timeout = timeout_ms / 1e3 if timeout_ms is not None else None
        self.starve = (
            starvation_ms / 1e3 if starvation_ms is not None else max(10 * self.max_delay, 0.05)
        )
        preferred = preferred_for(engine, preferred_sizes, self.max_batch_size)
        self.preferred = preferred
        self.name = name
        self.direct = bool(direct)
        self._cost = CostModel()
        self._arrivals = ArrivalRate()
        self._rate: ArrivalRate | None = self._arrivals if adaptive else None
        self._queue = WaitQueue()
        self._metrics = Metrics()
        # One lock guards the queue and the metrics; the hot paths take it directly (``with
        # self._lock`` skips a Python-level frame of Condition.__enter__ per request).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        # Finished batches, expired requests and wake-ups for the helper thread; None stops it.
        self._done: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._workers = int(workers)
        self._running = self._workers + standby
        # Per engine thread: when its running call is expected to end (inf: not in the engine).
        # Written by that thread, read by the helper without the lock (a hint: see
        # HelperThread._yield_to_engine).
        self._due = [math.inf] * self._running
        self._idle = 0  # workers waiting on the queue
        self._lent = 0  # of those, slots lent to callers running the engine themselves (infer)
        # Standby threads wait on their own Condition (same lock): submit() wakes one only when
        # no worker is idle and arrivals are sparse; _wake_newest() never picks one.
        self._standby_cv = threading.Condition(self._lock)
        self._standby_idle = 0
        self._standby_gap = math.inf  # arrivals sparser than this wake a standby thread
        self._plan: dict[Key, int] = {}  # group -> rows at which a waiting worker looks again
        self._wake_at = math.inf  # when a waiting worker looks again by itself
        self._timer_at = math.inf  # when the helper looks for expired requests by itself
        self._closing = False
        # Full batches the helper collated while every worker was in the engine (at most one
        # at a time). A queue, not an attribute under the lock: a worker leaving the engine
        # takes one with a single atomic get, without the lock that submit() and the helper
        # hold often (under overload it found the lock held at ~45% of its calls, then
        # blocked on it and on the interpreter lock after it).
        self._handoff: queue.SimpleQueue[Prepared] = queue.SimpleQueue()
        self._preparing = False
        self._buffer_sets: list[dict[Any, np.ndarray]] = []  # collation arrays not in use
        if warmup:
            for rows, seconds in run_warmup(engine, self.max_batch_size):
                self._cost.observe(rows, seconds)
            self._standby_threshold()
        # Engine threads (workers, then standby ones: slot k's due time is _due[k]), the helper.
        kinds = [("worker", i) for i in range(self._workers)] + [
            ("standby", i) for i in range(standby)
        ]
        self._threads = [
            threading.Thread(
                target=self._work,
                args=(kind == "standby", k),
                name=f"batcher-{name}-{kind}{i}",
                daemon=True,
            )
            for k, (kind, i) in enumerate(kinds)
        ] + [threading.Thread(target=self._help, name=f"batcher-{name}-helper", daemon=True)]
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
        return self._enqueue(self._prepare_sample(sample), priority, timeout_ms)

    def _prepare_sample(self, sample: Any) -> tuple[dict[str, np.ndarray], Form]:
        """The sample's feeds and form; an invalid one is counted and raises."""
        try:
            return self._layout.prepare(sample)
        except EngineInputError:
            with self._lock:
                self._metrics.submitted += 1
                self._metrics.outcomes["invalid"] += 1
            raise

    def _enqueue(
        self,
        prepared: tuple[dict[str, np.ndarray], Form],
        priority: int,
        timeout_ms: float | None,
    ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Queue a prepared sample (see :meth:`submit`)."""
        feeds, form = prepared
        now = time.monotonic()
        wait = self.timeout if timeout_ms is None else timeout_ms / 1e3
        deadline = math.inf if wait is None else now + wait
        request = Request(feeds, form, int(priority), now, deadline)
        with self._lock:
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
            rows = q.add(request)
            self._arrivals.observe(now)
            # Wake a waiting worker only when the batch it waits for may be ready: busy workers
            # look at the queue by themselves when their batch ends.
            if self._idle > self._lent:
                if rows >= self._plan.get(request.key, 1) or now >= self._wake_at:
                    self._wake_newest()
            elif self._standby_idle and self._standby_gap < math.inf and self._quiet(now):
                self._standby_cv.notify()
            elif rows == self.max_batch_size and self._handoff.empty():
                self._done.put(("wake",))  # every worker is busy: the helper collates it
            if request.deadline < self._timer_at:
                self._timer_at = request.deadline
                self._done.put(("wake",))
        return request.future

    def infer(
        self, sample: Any, *, priority: int = 0, timeout_ms: float | None = None
    ) -> dict[str, np.ndarray]:
        """Submit one sample and block until its outputs are ready (see :meth:`submit`).

        A request that would go out alone at once to an idle worker runs on this thread
        instead (see ``direct``)."""
        prepared = self._prepare_sample(sample)
        if self.direct and not self._queue.count and self._idle > self._lent:
            result = self._run_direct(Request(*prepared, int(priority), time.monotonic()))
            if result is not None:
                return result
        return self._enqueue(prepared, priority, timeout_ms).result()

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
                workers=self._workers,
                standby=self.standby,
                running_batches=self._running - self._idle - self._standby_idle + self._lent,
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
            dropped = [] if drain else self._queue.take_all()
            self._metrics.outcomes["closed"] += len(dropped)
            self._cv.notify_all()
            self._standby_cv.notify_all()
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

    def _wake_newest(self) -> None:
        """Wake the worker that went to wait last (under the lock). Condition.notify wakes the
        one waiting longest, so at low load lone requests would take turns between workers;
        last-in-first-out keeps them on one thread, whose core and caches are the ones the
        engine ran on last, and leaves the other workers for requests that arrive while it
        is busy. The waiter locks are the Condition's own (``_waiters``, newest last); a
        waiter that timed out meanwhile removes itself, as after notify()."""
        waiters = self._cv._waiters  # type: ignore[attr-defined]
        while waiters:
            waiter = waiters.pop()
            try:
                waiter.release()
                return
            except RuntimeError:  # released by a notify that was interrupted: awake already
                continue

    def _purge_cancelled(self) -> int:
        """Drop cancelled requests from the queue (under the lock); returns how many."""
        dropped = self._queue.purge_cancelled()
        self._metrics.outcomes["cancelled"] += dropped
        return dropped
