"""The Batcher's standby engine threads: calls beside a running one, only at low load.

With one worker, a request that arrives while a batch is inside the engine waits out that
batch, even on an engine that runs calls side by side on idle cores (a 1-thread ONNX Runtime
engine on 2 cores): at low load those requests make the latency tail (about twice a lone
call). A standby thread runs a batch only while no worker is idle, no full batch is being
collated, the engine's batch-1 call is long enough to be worth it (``MIN_CALL``) and arrivals
are sparse (fewer than ``QUIET`` expected during one batch-1 call);
under load it sleeps, since there the second core is worth more to the Python side of
submitting and resolving than to a second engine call (measured: two workers at overload
reached 0.50-0.79 of a two-call ceiling, one worker 0.9-1.0 of its one-call ceiling). A mixin
of :class:`enginekit.batcher.core.Batcher`, whose constructor sets the state declared here.
"""

from __future__ import annotations

import math
import queue
import threading
import time

from enginekit.batcher.helper import Prepared
from enginekit.batcher.metrics import Metrics
from enginekit.batcher.policy import ArrivalRate, CostModel
from enginekit.batcher.queue import WaitQueue
from enginekit.batcher.request import Key, Request

# What an engine thread runs next: taken requests or a prepared batch, and requests that expired.
Taken = tuple["list[Request] | None", list[Request], "Prepared | None"]
# A standby thread runs only while fewer than this many requests are expected to arrive during
# one batch-1 call (arrival rate x the cost model's batch-1 time): sparse arrivals, idle cores.
QUIET = 0.5
# ... and only for calls of at least this long (seconds): a shorter running call is over
# about as soon as a sleeping thread wakes and its engine call warms up (measured on 2 cores:
# a lone 1-thread call of the tests' small CNN 0.22 ms against 0.09 ms back to back), so
# waiting for the worker costs no more, and keeps lone requests on one thread.
MIN_CALL = 0.5e-3


class StandbyThreads:
    """When a standby thread runs (see the module docstring)."""

    # Set by Batcher.__init__; guarded by _lock (= the Conditions' lock).
    _standby_cv: threading.Condition
    _standby_idle: int
    _standby_gap: float  # see _standby_threshold
    _closing: bool
    _idle: int
    _lent: int  # idle workers' slots lent to callers (DirectRun)
    _queue: WaitQueue
    _metrics: Metrics
    _cost: CostModel
    _arrivals: ArrivalRate
    _handoff: queue.SimpleQueue[Prepared]
    _preparing: bool

    def _ready(self, now: float) -> tuple[list[Request] | None, float, dict[Key, int]]:
        raise NotImplementedError  # Batcher's: which requests to send now

    def _quiet(self, now: float) -> bool:
        """Whether arrivals are sparse enough for a standby thread to run (under the lock)."""
        return self._arrivals.expected_gap(now) > self._standby_gap

    def _standby_threshold(self) -> None:
        """Recompute, after the cost model changed, the expected gap between arrivals above
        which a standby thread runs (under the lock): ``QUIET`` batch-1 calls' worth, or never
        for calls shorter than ``MIN_CALL`` — so that submit() compares one number (it asks
        on every request while a standby thread sleeps)."""
        call = self._cost.predict(1)
        self._standby_gap = call / QUIET if call >= MIN_CALL else math.inf

    def _take_standby(self) -> Taken | None:
        """What a standby thread runs next (see :meth:`_take`): ready requests, only while no
        worker is idle, no full batch is being prepared (the sign of load) and arrivals are
        sparse; None once closing (the workers drain the queue)."""
        cv, q = self._standby_cv, self._queue
        while True:
            if self._closing:
                return None
            now = time.monotonic()
            wake = math.inf
            if (
                q.count
                and self._idle <= self._lent
                and self._handoff.empty()
                and not self._preparing
                and self._quiet(now)
            ):
                expired = q.expire(now) if q.has_deadlines else []
                if expired:
                    self._metrics.outcomes["expired"] += len(expired)
                taken, wake, _ = self._ready(now)
                if taken or expired:
                    if taken:
                        self._metrics.standby_batches += 1
                    return taken or [], expired, None
            self._standby_idle += 1
            cv.wait(None if math.isinf(wake) else max(wake - now, 0.0))
            self._standby_idle -= 1
