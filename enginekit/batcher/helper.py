"""The Batcher's helper thread, and the collation both it and the engine threads use.

The helper resolves the futures of finished batches (splitting the outputs per request) while
the engine threads already run the next batch, fails queued requests whose deadline passed —
on time, even while every engine thread is inside the engine — and collates the next full
batch while every engine thread is busy. A mixin of :class:`enginekit.batcher.core.Batcher`,
whose constructor sets the state declared here.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any

import numpy as np

from enginekit.batcher.metrics import Metrics
from enginekit.batcher.queue import WaitQueue
from enginekit.batcher.request import Key, Layout, Request, fail_expired
from enginekit.batcher.slot import resolve_all, start_all

# How long the helper sleeps to hand the interpreter lock to an engine thread that is most
# likely waiting for it (see HelperThread._yield_to_engine).
HANDOFF_S = 50e-6

# A collated batch: live requests, feeds (or the error collating them), rows, its arrays.
Prepared = tuple[list[Request], "dict[str, np.ndarray] | BaseException", int, dict[Any, np.ndarray]]


class HelperThread:
    """The helper thread's work and the collation step (see the module docstring)."""

    # Set by Batcher.__init__; guarded by _lock (= _cv's lock) unless said otherwise.
    name: str
    max_batch_size: int
    _cv: threading.Condition
    _lock: threading.Lock
    _done: queue.SimpleQueue[tuple[Any, ...] | None]
    _queue: WaitQueue
    _metrics: Metrics
    _layout: Layout
    _idle: int
    _lent: int  # idle workers' slots lent to callers (DirectRun)
    _timer_at: float
    _handoff: queue.SimpleQueue[Prepared]  # collated full batches for the workers
    _preparing: bool
    _buffer_sets: list[dict[Any, np.ndarray]]
    _due: list[float]  # per engine thread: when its running call is expected to end

    def _ready(self, now: float) -> tuple[list[Request] | None, float, dict[Key, int]]:
        raise NotImplementedError  # Batcher's: which requests to send now

    def _ran(self, rows: int, elapsed: float, ok: bool) -> None:
        raise NotImplementedError  # Batcher's: account a finished batch

    def _admit(
        self, requests: list[Request], buffers: dict[Any, np.ndarray]
    ) -> tuple[list[Request], dict[str, np.ndarray] | BaseException, int]:
        """Mark the taken requests running (dropping cancelled ones) and collate them."""
        started = start_all([r.future for r in requests])
        live = requests if all(started) else [r for r, ok in zip(requests, started) if ok]
        if len(live) < len(requests):  # counted before any later result can be seen
            with self._lock:
                self._metrics.outcomes["cancelled"] += len(requests) - len(live)
        rows = sum([r.rows for r in live])
        if not live:
            return live, {}, 0
        try:
            return live, self._layout.stack(live, rows, buffers), rows
        except BaseException as exc:  # fails this batch only
            return live, exc, rows

    def _prepare(self) -> None:
        """While every worker is inside the engine, collate the next full batch, so that the
        first worker out runs it without a gap (the helper thread calls this). Only full
        batches: a batch that may still grow is left to gather rows until a worker is free."""
        with self._cv:
            q = self._queue
            if (
                not self._handoff.empty()
                or self._preparing
                or self._idle > self._lent
                or not q.count
            ):
                return
            if not any(g.rows >= self.max_batch_size for g in q.groups.values()):
                return
            taken, _, _ = self._ready(time.monotonic())
            if not taken:
                return
            self._preparing = True
            buffers = self._buffer_sets.pop() if self._buffer_sets else {}
        live, feeds, rows = self._admit(taken, buffers)
        with self._cv:
            self._preparing = False
            if live:
                self._handoff.put((live, feeds, rows, buffers))
                self._metrics.prepared += 1
            else:
                self._buffer_sets.append(buffers)
            self._cv.notify_all()

    def _help(self) -> None:
        """Resolve the futures of finished batches, and fail queued requests whose deadline
        passed — on time, even while every worker is inside the engine."""
        cv, done, q = self._cv, self._done, self._queue
        while True:
            with cv:
                expired = q.expire(time.monotonic()) if q.has_deadlines else []
                if expired:
                    self._metrics.outcomes["expired"] += len(expired)
                self._timer_at = due = q.next_deadline()
            if expired:
                fail_expired(expired, self.name)
            try:
                item = done.get(timeout=None if math.isinf(due) else max(due - time.monotonic(), 0))
            except queue.Empty:
                continue
            if item is None:
                return
            self._yield_to_engine()
            self._finish(item)
            self._yield_to_engine()
            self._prepare()

    def _yield_to_engine(self) -> None:
        """Sleep briefly if an engine call has run past its expected end: its thread is then
        most likely waiting for the interpreter lock that this one holds, and gets it only when
        this thread blocks — a release that this thread takes back at once (as numpy's copies
        and ``time.sleep(0)`` do) wakes the waiter only to beat it to the lock, and restarts
        its 5 ms wait before it may ask for a switch. At most once per engine call."""
        due = self._due
        now = time.perf_counter()
        for i, at in enumerate(due):
            if at <= now:
                due[i] = math.inf
                time.sleep(HANDOFF_S)
                return

    def _finish(self, item: tuple[Any, ...], buffers: dict[Any, np.ndarray] | None = None) -> None:
        """Act on one message for the helper: a finished batch (split, account, count,
        resolve), expired requests to fail, or a wake-up (deadlines changed, a full batch to
        collate). A worker that resolves its own batch passes its collation buffers too."""
        if item[0] == "expired":
            fail_expired(item[1], self.name)
            return
        if item[0] == "wake":
            return
        requests, outputs, ok, ran = item
        if ok:
            try:
                results = self._layout.split(outputs, requests)
            except BaseException as exc:  # an engine that broke its output contract
                outputs, ok = exc, False
        # Count first: a caller that sees its result also sees it in stats().
        now = time.monotonic()
        latencies = [now - r.arrival for r in requests]
        with self._lock:
            m = self._metrics
            m.outcomes["completed" if ok else "failed"] += len(requests)
            m.add_many("latency", latencies)
            self._ran(*ran)
            if buffers is not None:
                self._buffer_sets.append(buffers)
        futures = [r.future for r in requests]
        if ok:
            resolve_all(futures, results)
        else:
            resolve_all(futures, None, outputs)
