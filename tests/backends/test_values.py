"""ProgramCache: programs for new value sets compile outside the lock, once per key.

A TVM compile takes seconds; under one lock every other thread (even one whose values are
compiled already) waited for it. The compile of a key is blocked on an Event here, so each test
sees the other threads' calls while it is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from enginekit.backends import values
from enginekit.errors import BuildError

# Liveness bound for a thread that should finish; not a timing assertion.
_WAIT_S = 30


def _key(i: int) -> values.Key:
    return values.key({"v": np.array([i])})


class _Cache(values.ProgramCache[str]):
    """Counts the threads that joined a compile in flight."""

    def __init__(self, size: int = values.CACHE_SIZE) -> None:
        super().__init__(size)
        self.joined = threading.Semaphore(0)

    def _wait(self, pending):
        self.joined.release()
        return super()._wait(pending)


class _Blocked:
    """A compile that starts, then waits for :attr:`release`; counts its calls."""

    def __init__(self, result: str, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.started, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        self.started.set()
        assert self.release.wait(_WAIT_S)
        if self.error is not None:
            raise self.error
        return self.result


def _start(call: Callable[[], str], out: list) -> threading.Thread:
    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # reported to the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(_WAIT_S)
        assert not t.is_alive()


def test_a_cached_key_and_another_new_key_do_not_wait_for_a_compile_in_flight():
    cache = _Cache()
    cache.put(_key(2), "b")
    slow = _Blocked("a")
    got_a: list = []
    first = _start(lambda: cache.get(_key(1), slow), got_a)
    try:
        assert slow.started.wait(_WAIT_S)
        others: list = []
        _join(
            [
                _start(lambda: cache.get(_key(2), lambda: "never"), others),
                _start(lambda: cache.get(_key(3), lambda: "c"), others),
            ]
        )
        assert sorted(others) == ["b", "c"]
        assert got_a == []  # still compiling
    finally:
        slow.release.set()
    _join([first])
    assert got_a == ["a"]
    assert [p for _, p in cache.items()] == ["b", "c", "a"]


def test_concurrent_calls_for_one_new_key_compile_it_once():
    cache = _Cache()
    slow = _Blocked("a")
    got: list = []
    threads = [_start(lambda: cache.get(_key(1), slow), got)]
    assert slow.started.wait(_WAIT_S)
    threads += [_start(lambda: cache.get(_key(1), slow), got) for _ in range(3)]
    for _ in range(3):
        assert cache.joined.acquire(timeout=_WAIT_S)
    slow.release.set()
    _join(threads)
    assert got == ["a"] * 4
    assert slow.calls == 1
    assert len(cache) == 1


def test_a_compile_error_reaches_every_waiter_and_the_next_call_retries():
    cache = _Cache()
    slow = _Blocked("a", BuildError("values [9] do not compile"))
    got: list = []
    threads = [_start(lambda: cache.get(_key(1), slow), got)]
    assert slow.started.wait(_WAIT_S)
    threads += [_start(lambda: cache.get(_key(1), slow), got) for _ in range(2)]
    for _ in range(2):
        assert cache.joined.acquire(timeout=_WAIT_S)
    slow.release.set()
    _join(threads)
    assert len(got) == 3
    assert all(isinstance(e, BuildError) and "[9]" in str(e) for e in got)
    assert slow.calls == 1
    assert len(cache) == 0  # the failure is not remembered
    assert cache.get(_key(1), lambda: "a, now") == "a, now"
    assert cache.get(_key(1), lambda: "never") == "a, now"


def test_eviction_never_drops_a_key_in_flight_from_its_waiters():
    cache = _Cache(size=1)
    slow = _Blocked("a")
    got: list = []
    threads = [_start(lambda: cache.get(_key(1), slow), got)]
    assert slow.started.wait(_WAIT_S)
    threads.append(_start(lambda: cache.get(_key(1), slow), got))
    assert cache.joined.acquire(timeout=_WAIT_S)
    # The LRU fills and evicts while a is compiling: b goes, c stays.
    assert cache.get(_key(2), lambda: "b") == "b"
    assert cache.get(_key(3), lambda: "c") == "c"
    assert [p for _, p in cache.items()] == ["c"]
    slow.release.set()
    _join(threads)
    assert got == ["a", "a"]
    assert slow.calls == 1
    # a joined the LRU as its most recent entry and evicted c.
    assert [p for _, p in cache.items()] == ["a"]
    assert cache.get(_key(1), lambda: "never") == "a"


def test_an_interrupted_compile_is_not_left_in_flight():
    cache = values.ProgramCache[str]()

    def interrupted() -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.get(_key(1), interrupted)
    assert cache.get(_key(1), lambda: "a") == "a"


def test_a_compile_that_ends_after_clear_goes_to_its_callers_not_the_cache():
    """The engine closed in the middle of a compile: the waiting call still gets its program,
    but the emptied cache does not keep it (it would hold it until the engine is collected)."""
    cache = _Cache()
    slow = _Blocked("a")
    got: list = []
    first = _start(lambda: cache.get(_key(1), slow), got)
    try:
        assert slow.started.wait(_WAIT_S)
        cache.clear()
    finally:
        slow.release.set()
    _join([first])
    assert got == ["a"] and len(cache) == 0 and cache.items() == []
