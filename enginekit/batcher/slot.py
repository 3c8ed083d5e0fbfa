"""A lighter ``concurrent.futures.Future`` for the batcher's requests, resolved a batch at a time.

A stock Future builds a ``threading.Condition`` (a Python object around an RLock) for every
request, enters it through a Python-level ``__enter__`` on every call, and notifies it on every
state change even when nobody waits. At tens of thousands of requests per second that is a large
share of the batcher's own cost. A :class:`Slot` is still a ``concurrent.futures.Future`` (so
``asyncio.wrap_future``, ``concurrent.futures.wait`` and ``as_completed`` work on it) but:

* its ``_condition`` is one Condition shared by every Slot, over an RLock (re-entrant, because
  ``concurrent.futures.wait`` acquires the ``_condition`` of each future it is given; the
  critical sections are a few attribute writes); it is never waited on or notified;
* a thread that blocks in ``result()``/``exception()`` parks on its own lock, created only then,
  and only that thread is woken when the Slot resolves (no notify when nobody waits);
* :func:`start_all` and :func:`resolve_all` change the state of a whole batch under one
  acquisition of the shared lock, then run the done-callbacks outside it (as Future does).

It relies on the attributes every CPython since 3.2 gives Future (``_state``, ``_result``,
``_exception``, ``_waiters``, ``_done_callbacks``, ``_condition``); tests/batcher/test_slot.py
checks it against the stdlib helpers that read them. ``_waiters`` and ``_done_callbacks`` are
made on first use, not per request: a queued request holds no list for the cyclic GC to walk.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, TimeoutError
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    LOGGER,
    PENDING,
    RUNNING,
)
from typing import Any

# Guards the state of every Slot; its holders never block and never call out. The stdlib's
# helpers take it through the Condition (never waited on or notified); Slot takes it directly.
_GUARD = threading.RLock()
_CONDITION = threading.Condition(_GUARD)
_DONE = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)


class Slot(Future[Any]):
    """A Future without a Condition of its own (see the module docstring)."""

    # Future's per-instance lists, made only when used: a queued request then holds no list
    # the cyclic GC walks (a backlog of tens of thousands of requests made its collections
    # ~1.5 us of each submit's ~4.5). _w: the waiter list concurrent.futures.wait and
    # as_completed append to (through _waiters), None until they do.
    __slots__ = ("_w",)
    _done_callbacks: Any = ()  # a list once add_done_callback adds one

    def __init__(self) -> None:  # no super().__init__(): that builds the Condition
        self._condition = _CONDITION
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._w: list[Any] | None = None
        self._sleepers: list[Any] | None = None  # locks of threads blocked in result()

    @property
    def _waiters(self) -> list[Any]:
        """Future's waiter list, for the stdlib helpers (made on their first use)."""
        w = self._w
        if w is None:
            w = self._w = []
        return w

    @_waiters.setter
    def _waiters(self, value: list[Any]) -> None:
        self._w = value

    # -- waiting -------------------------------------------------------------------------------

    def _wait(self, timeout: float | None) -> None:
        """Block until resolved or ``timeout`` seconds pass (the caller checks which)."""
        if self._state in _DONE:
            return
        with _GUARD:
            if self._state in _DONE:
                return
            lock = _thread.allocate_lock()
            lock.acquire()
            if self._sleepers is None:
                self._sleepers = []
            self._sleepers.append(lock)
        if timeout is None:
            lock.acquire()
        elif not lock.acquire(True, max(timeout, 0.0)):
            with _GUARD:
                if self._sleepers is not None and lock in self._sleepers:
                    self._sleepers.remove(lock)

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        state = self._state
        if state == FINISHED:
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # type: ignore[assignment]  # break the traceback's cycle
            return self._result
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            raise CancelledError()
        raise TimeoutError()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        state = self._state
        if state == FINISHED:
            return self._exception
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            raise CancelledError()
        raise TimeoutError()

    def add_done_callback(self, fn: Any) -> None:
        with _GUARD:  # the lock itself: Condition.__enter__ is a Python-level call
            if self._state not in _DONE:
                if self._done_callbacks:
                    self._done_callbacks.append(fn)
                else:
                    self._done_callbacks = [fn]
                return
        try:
            fn(self)
        except Exception:
            LOGGER.exception("exception calling callback for %r", self)

    # A state only moves forward and is one attribute: reading it needs no lock.
    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED)

    def running(self) -> bool:
        return self._state == RUNNING

    def _run_callbacks(self) -> None:
        """Future's _invoke_callbacks (not part of its typed interface)."""
        for callback in self._done_callbacks:
            try:
                callback(self)
            except Exception:
                LOGGER.exception("exception calling callback for %r", self)

    # -- changing state ------------------------------------------------------------------------

    def _wake(self) -> None:
        """Release the threads blocked in result() (under the guard)."""
        sleepers = self._sleepers
        if sleepers:
            self._sleepers = None
            for lock in sleepers:
                lock.release()

    def cancel(self) -> bool:
        with _GUARD:
            if self._state in (RUNNING, FINISHED):
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            self._state = CANCELLED
            self._wake()
        self._run_callbacks()
        return True

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._finish(None, exception)

    def _finish(self, result: Any, exception: BaseException | None) -> None:
        with _GUARD:
            self._settle(result, exception)
        if self._done_callbacks:
            self._run_callbacks()

    def _settle(self, result: Any, exception: BaseException | None) -> None:
        """Resolve (under the guard); raises InvalidStateError if already done."""
        if self._state in _DONE:
            raise InvalidStateError(f"{self._state}: {self!r}")
        self._result = result
        self._exception = exception
        self._state = FINISHED
        for waiter in self._w or ():
            if exception is None:
                waiter.add_result(self)
            else:
                waiter.add_exception(self)
        self._wake()


def start_all(slots: Iterable[Slot]) -> list[bool]:
    """``set_running_or_notify_cancel()`` on each slot under one acquisition of the guard:
    True for each slot now running, False for each that was cancelled."""
    out = []
    with _GUARD:
        for s in slots:
            state = s._state
            if state == PENDING:
                s._state = RUNNING
                out.append(True)
            elif state == CANCELLED:
                s._state = CANCELLED_AND_NOTIFIED
                for waiter in s._w or ():
                    waiter.add_cancelled(s)
                out.append(False)
            else:
                raise RuntimeError(f"Future in unexpected state: {state}")
    return out


def resolve_all(
    slots: Sequence[Slot], results: Sequence[Any] | None, exception: BaseException | None = None
) -> None:
    """Resolve running slots with ``results`` (one each), or all with ``exception``, under one
    acquisition of the guard (skipping any already resolved); then run their done-callbacks."""
    with _GUARD:
        if results is None:
            for s in slots:
                if s._state not in _DONE:
                    s._settle(None, exception)
        else:
            # _settle inlined for the common slot, running with nobody waiting on it: on the
            # helper's path this loop runs once per request, holding the interpreter lock that
            # the engine thread wants back when its call returns.
            for s, r in zip(slots, results):
                if s._state == RUNNING and not s._w and not s._sleepers:
                    s._result = r
                    s._state = FINISHED
                elif s._state not in _DONE:
                    s._settle(r, None)
    for s in slots:
        if s._done_callbacks:
            s._run_callbacks()
