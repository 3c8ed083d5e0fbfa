"""The Batcher's blocking ``infer()`` on the caller's own thread, when nothing would batch with it.

A blocking caller that submits a lone request while a worker sits idle would otherwise hand it
to that worker and block: the worker wakes (a thread switch, and on a busy machine a wait for a
core), runs the engine, resolves the future and wakes the caller (another switch). Measured on
2 loaded cores, that hand-off added 0.25-0.3 ms to the median of a lone batch-1 call (0.24 ms for
the small CNN) and 3 ms to its p90, because each woken thread waits for a core. When the queue
is empty, a worker is idle and the policy would send a one-row batch at once anyway, the caller
runs the engine itself instead: the same batch, with no thread in between.

The caller borrows an idle worker's slot for the call (``_lent``): while it runs, the workers
count it as one of theirs being busy, so the engine never runs more calls at once than
``workers`` (plus standby threads, which may run beside it exactly as beside a worker), and
requests that arrive meanwhile queue as they would behind a worker's batch. When the call ends
the slot returns and a waiting worker is woken for whatever queued. A mixin of
:class:`enginekit.batcher.core.Batcher`, whose constructor sets the state declared here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from enginekit.batcher.metrics import Metrics
from enginekit.batcher.policy import ArrivalRate, CostModel, decide
from enginekit.batcher.queue import WaitQueue
from enginekit.batcher.request import Layout, Request
from enginekit.engine import Engine

log = logging.getLogger(__name__)


class DirectRun:
    """A lone blocking request run on its caller's thread (see the module docstring)."""

    # Set by Batcher.__init__; guarded by _lock (= _cv's lock).
    engine: Engine
    name: str
    max_batch_size: int
    max_delay: float
    direct: bool
    _cv: threading.Condition
    _lock: threading.Lock
    _layout: Layout
    _queue: WaitQueue
    _metrics: Metrics
    _cost: CostModel
    _arrivals: ArrivalRate
    _rate: ArrivalRate | None
    _idle: int  # workers waiting on the queue
    _lent: int  # of those, how many lent their slot to a caller running the engine itself
    _closing: bool
    _handoff: Any
    _preparing: bool
    _threads: list[threading.Thread]

    def _ran(self, rows: int, elapsed: float, ok: bool) -> None:
        raise NotImplementedError  # Batcher's: account a finished batch

    def _wake_newest(self) -> None:
        raise NotImplementedError  # Batcher's: wake the worker that went to wait last

    def _run_direct(self, request: Request) -> dict[str, np.ndarray] | None:
        """Run ``request`` on this thread if it would go out alone at once to an idle engine;
        its outputs, or None when it must take the queue (the caller then submits it as
        usual). Counted in ``stats()`` like any batch, with the dispatch reason "direct"."""
        if threading.current_thread() in self._threads:
            return None  # a result callback on one of ours: never hold its slot twice
        now = request.arrival
        with self._lock:
            if (
                self._closing
                or self._idle <= self._lent
                or self._queue.count
                or not self._handoff.empty()
                or self._preparing
                or not decide(
                    request.rows,
                    self.max_batch_size,
                    now,
                    now,
                    self.max_delay,
                    self._rate,
                    self._cost,
                ).send
            ):
                return None
            self._lent += 1
            m = self._metrics
            m.submitted += 1
            m.reasons["direct"] += 1
            m.add("queue_wait", 0.0)
            self._arrivals.observe(now)
        ok, elapsed = False, 0.0
        try:
            # A lone unpadded request's feeds are the batch as they are (no copy); a padded one
            # gets arrays of its own.
            feeds = self._layout.stack([request], request.rows, {})
            start = time.perf_counter()
            try:
                outputs = self.engine.infer(feeds)
            except BaseException as exc:  # raised to this caller, as its future would
                log.warning(
                    "batcher %r: a batch of %d rows failed: %r", self.name, request.rows, exc
                )
                raise
            finally:
                elapsed = time.perf_counter() - start
            result = self._layout.split(outputs, [request])[0]
            ok = True
            return result
        finally:
            with self._lock:
                self._lent -= 1
                m.outcomes["completed" if ok else "failed"] += 1
                m.add("latency", time.monotonic() - now)
                self._ran(request.rows, elapsed, ok)
                # Requests that queued meanwhile waited as behind a worker's batch: the worker
                # whose slot this was looks at them now (a closing Batcher's workers wait for
                # this call before they end).
                if self._closing:
                    self._cv.notify_all()
                elif self._queue.count or not self._handoff.empty():
                    self._wake_newest()
