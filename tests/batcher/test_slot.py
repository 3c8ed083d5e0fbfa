"""Slot behaves as a concurrent.futures.Future for every caller that reads one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from enginekit.batcher.slot import Slot, resolve_all, start_all


def test_result_blocks_until_resolved_from_another_thread() -> None:
    slots = [Slot() for _ in range(3)]
    got: list[object] = []
    waiters = [threading.Thread(target=lambda s=s: got.append(s.result())) for s in slots]
    waiters.append(threading.Thread(target=lambda: got.append(slots[0].result())))  # 2 on one
    for t in waiters:
        t.start()
    assert start_all(slots) == [True, True, True]
    assert all(s.running() for s in slots)
    resolve_all(slots, ["a", "b", "c"])
    for t in waiters:
        t.join(10)
    assert sorted(map(str, got)) == ["a", "a", "b", "c"]
    assert [s.result(0) for s in slots] == ["a", "b", "c"]


def test_timeout_cancel_and_exception() -> None:
    s = Slot()
    with pytest.raises(concurrent.futures.TimeoutError):
        s.result(0.01)
    with pytest.raises(concurrent.futures.TimeoutError):
        s.exception(0)
    assert s._sleepers == []  # a waiter that timed out leaves nothing behind
    assert s.cancel() and s.cancelled() and s.done()
    with pytest.raises(concurrent.futures.CancelledError):
        s.result()
    assert start_all([s]) == [False]  # cancelled before it ran: not run

    running, failing = Slot(), Slot()
    assert start_all([running, failing]) == [True, True]
    assert not running.cancel()  # too late once running
    error = ValueError("bad batch")
    resolve_all([failing], None, error)
    assert failing.exception() is error
    with pytest.raises(ValueError, match="bad batch"):
        failing.result()
    running.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):
        running.set_result(2)


def test_callbacks_and_stdlib_helpers() -> None:
    slots = [Slot() for _ in range(4)]
    seen: list[concurrent.futures.Future[object]] = []
    slots[0].add_done_callback(seen.append)
    start_all(slots)

    def later() -> None:
        resolve_all(slots[:2], [0, 1])
        resolve_all(slots[2:], None, KeyError("x"))

    threading.Timer(0.02, later).start()
    done, pending = concurrent.futures.wait(slots, timeout=10)
    assert len(done) == 4 and not pending
    assert seen == [slots[0]]
    assert sorted(str(f.exception()) for f in concurrent.futures.as_completed(slots)) == [
        "'x'",
        "'x'",
        "None",
        "None",
    ]
    slots[1].add_done_callback(seen.append)  # already done: runs at once
    assert seen == [slots[0], slots[1]]
    assert "finished" in repr(slots[1])


def test_asyncio_wrap_future() -> None:
    async def main() -> tuple[object, bool]:
        ok, dropped = Slot(), Slot()
        awaited = asyncio.ensure_future(asyncio.wrap_future(dropped))
        await asyncio.sleep(0)
        awaited.cancel()  # cancelling the awaiting task cancels the slot
        await asyncio.sleep(0)
        start_all([ok])
        asyncio.get_running_loop().call_later(0.01, ok.set_result, "r")
        return await asyncio.wrap_future(ok), dropped.cancelled()

    assert asyncio.run(main()) == ("r", True)


def test_a_queued_slot_holds_no_list_until_a_caller_needs_one() -> None:
    import gc

    # A backlog of queued requests is walked by every full collection: no per-request lists.
    s = Slot()
    assert not [r for r in gc.get_referents(s) if isinstance(r, list)]
    seen: list[object] = []
    s.add_done_callback(seen.append)
    done, pending = concurrent.futures.wait([s], timeout=0)  # made the waiter list, emptied it
    assert not done and pending == {s} and s._waiters == []
    threading.Timer(0.01, lambda: resolve_all([s], [7]) if start_all([s]) else None).start()
    done, _ = concurrent.futures.wait([s], timeout=10)
    assert done == {s} and s.result() == 7 and seen == [s]
