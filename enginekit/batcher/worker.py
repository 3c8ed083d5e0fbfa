"""The Batcher's engine threads: take the next batch, run it, hand it on.

An idle worker waits on the queue itself and is woken by submit() only when a batch could be
ready (the policy says at how many rows, or at what time, the answer flips), so a request
reaches the engine with one thread switch. A worker hands each finished batch to the helper,
which splits the outputs and resolves the futures while the worker already runs the next
batch. A mixin of :class:`enginekit.batcher.core.Batcher`, whose constructor sets the state
declared here; it comes first among the Batcher's bases, so the methods here are the ones the
other mixins' declarations of ``_ready`` and ``_ran`` stand for.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from enginekit.batcher.helper import Prepared
from enginekit.batcher.metrics import Metrics
from enginekit.batcher.policy import ArrivalRate, CostModel, decide, take_size
from enginekit.batcher.queue import WaitQueue
from enginekit.batcher.request import Key, Layout, Request
from enginekit.batcher.standby import Taken
from enginekit.engine import Engine

log = logging.getLogger(__name__)

# A worker resolves a batch of at most this many requests itself even when more wait.
INLINE_RESOLVE = 4


class EngineThreads:
    """What a worker (or standby) thread runs (see the module docstring)."""

    # Set by Batcher.__init__; guarded by _lock (= _cv's lock) unless said otherwise.
    engine: Engine
    name: str
    max_batch_size: int
    max_delay: float
    starve: float
    preferred: tuple[int, ...]
    _lock: threading.Lock
    _cv: threading.Condition
    _done: queue.SimpleQueue[tuple[Any, ...] | None]
    _due: list[float]
    _cost: CostModel
    _rate: ArrivalRate | None
    _queue: WaitQueue
    _metrics: Metrics
    _layout: Layout
    _buffer_sets: list[dict[Any, np.ndarray]]
    _handoff: queue.SimpleQueue[Prepared]
    _preparing: bool
    _closing: bool
    _running: int
    _idle: int
    _lent: int
    _plan: dict[Key, int]
    _wake_at: float
    # The other mixins' methods (annotations only: a stub here would shadow them).
    _take_standby: Callable[[], Taken | None]
    _admit: Callable[
        [list[Request], dict[Any, np.ndarray]],
        tuple[list[Request], dict[str, np.ndarray] | BaseException, int],
    ]
    _finish: Callable[..., None]
    _standby_threshold: Callable[[], None]

    def _work(self, standby: bool = False, slot: int = 0) -> None:
        """An engine thread: take the next batch (one the helper prepared, or a ready one from
        the queue, waiting as long as there is none), run it, hand the outputs to the helper,
        which resolves the futures while this one runs the next batch. Returns once closing
        and nothing is left to run (a standby thread: once closing)."""
        engine, lock, done, due, cost = self.engine, self._lock, self._done, self._due, self._cost
        handoff, q = self._handoff, self._queue
        give_back = False  # the last batch's collation arrays go back to the pool
        buffers: dict[Any, np.ndarray] = {}
        while True:
            taken: Taken | None = None
            # A batch the helper collated, taken without the lock when nothing else needs
            # looking at (no lent slot, no deadlines: hints, read without the lock; the locked
            # path below handles both): under overload, the common case between two calls.
            if not standby and not self._lent and not q.has_deadlines:
                try:
                    taken = None, [], handoff.get_nowait()
                except queue.Empty:
                    pass
            if taken is not None:
                if give_back:  # list.append is atomic; the others pop under the lock
                    self._buffer_sets.append(buffers)
            else:
                with lock:  # the Condition's lock, entered without its Python-level __enter__
                    if give_back:
                        self._buffer_sets.append(buffers)
                    taken = self._take_standby() if standby else self._take()
                    if taken is not None and taken[0] is not None:
                        buffers = self._buffer_sets.pop() if self._buffer_sets else {}
                if taken is None:
                    break
            requests, expired, prepared = taken
            if expired:
                done.put(("expired", expired))
            if prepared is not None:
                live, feeds, rows, buffers = prepared
            else:
                assert requests is not None  # either requests or a prepared batch
                live, feeds, rows = self._admit(requests, buffers)
            if not live:
                give_back = False
                continue
            start = time.perf_counter()
            due[slot] = start + cost.predict(rows)
            try:
                if isinstance(feeds, BaseException):
                    raise feeds
                outputs: Any = engine.infer(feeds)
                due[slot] = math.inf  # out of the engine, holding the interpreter lock again
                if feeds is not live[0].feeds:
                    outputs = self._layout.detach(outputs, buffers)
                ok = True
            except BaseException as exc:  # handed to the batch's futures
                outputs, ok = exc, False
                log.warning("batcher %r: a batch of %d rows failed: %r", self.name, rows, exc)
            due[slot] = math.inf
            elapsed = time.perf_counter() - start
            # Reads without the lock: a hint is enough here. A few futures cost less to resolve
            # here than waking the helper does (a thread switch, and the interpreter lock
            # taken from this thread just as it starts the next batch).
            if len(live) > INLINE_RESOLVE and (self._queue.count or not self._handoff.empty()):
                # The helper resolves and accounts for the batch (the cost model, the metrics):
                # between two engine calls this thread only picks up the next batch.
                give_back = True
                done.put((live, outputs, ok, (rows, elapsed, ok)))
            else:
                # Resolve here, accounting for the batch in the same lock round-trip, so that
                # little is left to do between waking the callers and blocking or starting the
                # next batch (the callers need the interpreter lock this thread holds).
                give_back = False
                self._finish((live, outputs, ok, (rows, elapsed, ok)), buffers)
                if self._queue.rows >= self.max_batch_size:
                    done.put(("wake",))  # the helper collates a full batch while this one runs
        with lock:
            self._running -= 1
            last = self._running == 0
        if last:
            done.put(None)  # the helper ends after what is queued before this

    def _ran(self, rows: int, elapsed: float, ok: bool) -> None:
        """Account a finished batch (under the lock)."""
        m = self._metrics
        m.batches += 1
        m.batch_rows[rows] += 1
        m.add("engine", elapsed)
        if ok:
            self._cost.observe(rows, elapsed)
            self._standby_threshold()

    def _take(self) -> Taken | None:
        """What to run next — requests from the queue, or a batch the helper prepared — and the
        requests that expired meanwhile, waiting as long as there is none (under the lock);
        None once closing with nothing left to run."""
        cv, q = self._cv, self._queue
        plan: dict[Key, int]
        while True:
            if self._lent > self._idle:
                # A caller runs the engine in a slot lent by an idle worker (DirectRun), and no
                # other idle worker stands for it: this one is busy until the slot returns.
                self._idle += 1
                cv.wait()
                self._idle -= 1
                continue
            now = time.monotonic()
            expired = q.expire(now) if q.has_deadlines else []
            if expired:
                self._metrics.outcomes["expired"] += len(expired)
            try:
                return None, expired, self._handoff.get_nowait()
            except queue.Empty:
                pass
            if self._preparing:  # the helper collates the oldest rows: run them first
                if expired:
                    return [], expired, None
                cv.wait()
                continue
            if not q.count:
                if self._closing:
                    return None
                taken, wake, plan = None, math.inf, {}
            else:
                taken, wake, plan = self._ready(now)
            if taken:
                return taken, expired, None
            if expired:
                return [], expired, None
            # Nothing to send: wait, and tell submit() when waking this thread is worth it.
            self._idle += 1
            self._plan, self._wake_at = plan, wake
            cv.wait(None if math.isinf(wake) else max(wake - now, 0.0))
            self._idle -= 1

    def _ready(self, now: float) -> tuple[list[Request] | None, float, dict[Key, int]]:
        """The requests to send now if any; otherwise when to look again and, per group, the
        row count at which to look again (under the lock)."""
        best: tuple[Any, ...] | None = None
        best_rank: tuple[bool, int, int] | None = None
        wake, plan = math.inf, {}
        closing = self._closing
        for key, group in self._queue.groups.items():
            oldest = group.oldest()
            if oldest is None:
                continue
            if closing:
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
                    plan[key] = d.need
                    continue
                reason = d.reason
            if best is None:  # rank only when groups compete (one group is the common case)
                best = (group, reason)
                continue
            if best_rank is None:
                best_rank = best[0].rank(now, self.starve)
            rank = group.rank(now, self.starve)
            if rank > best_rank:
                best, best_rank = (group, reason), rank
        if best is None:
            return None, wake, plan
        group, reason = best
        size = take_size(group.rows, self.max_batch_size, self.preferred, reason)
        taken = self._queue.take(group, size, now, self.starve)
        m = self._metrics
        m.reasons[reason] += 1
        m.add_many("queue_wait", [now - r.arrival for r in taken])
        return taken, now, plan
