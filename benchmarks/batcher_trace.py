"""Request-by-request timelines for benchmarks/batcher.py's --trace: where a slow request's time went.

Each sample is tagged with its request number inside its own data (an image's first pixel, or
two token ids of a sequence), and the engine is wrapped in one that records, for every call, the
tags it sees, when it started and ended and on which thread. Nothing is added to the batcher's
path: the tags travel through collation like any other value. Per request the trace then has

  arrival (scheduled) -> submitted (the generator's submit returned) -> engine start -> engine
  end -> done (the Future's completion callback ran)

and each request in the slowest 2% is put in one class, the first that applies:

  late submit   the generator submitted it more than 1 ms after its scheduled time (the load
                generator's sleep overshot, or it waited for the interpreter lock)
  queued        every thread that runs calls was in one when it was submitted, and it started
                only once one came free (it waited out a running call)
  window        it waited >= 1.5 ms for the engine while no call ran (the delay window)
  dispatch      it waited > 0.5 ms for the engine while no call ran (thread wake-up, collation)
  slow engine   its engine call took > 1.25 x the median call of its size
  resolve       its Future completed > 0.5 ms after its engine call ended
  other         none of these
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import enginekit as ek

CLASSES = ("late submit", "queued", "window", "dispatch", "slow engine", "resolve", "other")


class Call(NamedTuple):
    """One engine call: the request numbers it ran, its times, its thread. (A NamedTuple: this
    module is loaded by path, outside sys.modules, where a dataclass cannot resolve its
    annotations.)"""

    tags: tuple[int, ...]
    start: float
    end: float
    thread: int


class Traced(ek.Engine):
    """An engine that records every call (tags, start, end, thread) and then runs ``inner``."""

    def __init__(self, inner: ek.Engine, read_tags: Callable[[dict[str, np.ndarray]], Any]):
        super().__init__(inner.inputs, inner.outputs, inner.profiles, inner.manifest)
        self.inner = inner
        self.read_tags = read_tags
        self.calls: list[Call] = []

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tags = tuple(int(t) for t in self.read_tags(feeds))
        start = time.perf_counter()
        out = self.inner.infer(feeds)
        end = time.perf_counter()
        self.calls.append(Call(tags, start, end, threading.get_ident()))  # list.append: atomic
        return out


def tagger(sample: Any) -> tuple[Callable[[Any, int], Any], Callable[[dict], np.ndarray]]:
    """(tag a row with a number, read the numbers of a batch's rows) for this model's samples:
    an image's first value, or a sequence's first two token ids (number = id1 + 1000 * id2)."""
    if isinstance(sample, dict) and "input_ids" in sample:

        def tag_ids(row: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
            ids = row["input_ids"].copy()
            ids[..., 0], ids[..., 1] = n % 1000, n // 1000
            return {**row, "input_ids": ids}

        def read_ids(feeds: dict[str, np.ndarray]) -> np.ndarray:
            ids = feeds["input_ids"]
            return ids[:, 0] + 1000 * ids[:, 1]

        return tag_ids, read_ids

    def tag_image(row: np.ndarray, n: int) -> np.ndarray:
        row = row.copy()
        row.reshape(-1)[0] = n
        return row

    def read_image(feeds: dict[str, np.ndarray]) -> np.ndarray:
        x = next(iter(feeds.values()))
        return x.reshape(len(x), -1)[:, 0]

    return tag_image, read_image


def timelines(
    calls: list[Call],
    start: float,
    arrivals: np.ndarray,
    submitted: list[float],
    done: np.ndarray,
    capacity: int = 1,
) -> list[dict[str, Any]]:
    """One dict per request that completed: its times and class. ``capacity``: how many calls
    can run at once (the batcher's workers, the pool's threads); a request waits behind
    running calls only when that many were running when it was submitted."""
    of: dict[int, Call] = {}
    for c in calls:
        for t in c.tags:
            of[t] = c
    ordered = sorted(calls, key=lambda c: c.start)
    starts = np.array([c.start for c in ordered])
    median: dict[int, float] = {}
    for size in {len(c.tags) for c in calls}:
        median[size] = float(np.median([c.end - c.start for c in calls if len(c.tags) == size]))
    out = []
    for i, call in sorted(of.items()):
        if i >= len(submitted) or np.isnan(done[i]):
            continue
        arrival, sub = start + arrivals[i], submitted[i]
        # The calls that had started before this one was submitted and were still running.
        before = ordered[: int(np.searchsorted(starts, sub))]
        running = [c for c in before if c.end > sub and c is not call]
        wait = call.start - sub
        # Every thread busy: it could start no earlier than the first of them came free.
        busy_until = min(c.end for c in running) if len(running) >= capacity else sub
        row = {
            "request": i,
            "latency_ms": (done[i] - arrival) * 1e3,
            "late_submit_ms": (sub - arrival) * 1e3,
            "wait_ms": wait * 1e3,
            "engine_ms": (call.end - call.start) * 1e3,
            "resolve_ms": (done[i] - call.end) * 1e3,
            "batch": len(call.tags),
            "running_at_submit": len(running),
            "behind_ms": max(busy_until - sub, 0.0) * 1e3,
            "capacity": capacity,
        }
        row["class"] = classify(row, median[len(call.tags)] * 1e3)
        out.append(row)
    return out


def classify(row: dict[str, Any], median_engine_ms: float) -> str:
    """The first class of the module docstring's list that applies to ``row``."""
    if row["late_submit_ms"] > 1.0:
        return "late submit"
    if row["behind_ms"] > 0 and row["wait_ms"] >= row["behind_ms"] - 0.05:
        return "queued"
    idle_wait = row["wait_ms"] - row["behind_ms"]
    if idle_wait >= 1.5:
        return "window"
    if idle_wait > 0.5:
        return "dispatch"
    if row["engine_ms"] > 1.25 * median_engine_ms:
        return "slow engine"
    if row["resolve_ms"] > 0.5:
        return "resolve"
    return "other"


def summary(rows: list[dict[str, Any]], share: float = 0.02) -> dict[str, Any]:
    """The slowest ``share`` of requests: counts per class and their timelines; medians of all."""
    by_latency = sorted(rows, key=lambda r: r["latency_ms"], reverse=True)
    tail = by_latency[: max(1, round(share * len(rows)))]
    counts = {c: sum(r["class"] == c for r in tail) for c in CLASSES}
    keys = ("latency_ms", "late_submit_ms", "wait_ms", "engine_ms", "resolve_ms")
    medians = {k: float(np.median([r[k] for r in rows])) for k in keys}
    return {"requests": len(rows), "tail": tail, "tail_classes": counts, "medians": medians}


def print_summary(label: str, s: dict[str, Any]) -> None:
    m = s["medians"]
    print(
        f"  trace {label}: {s['requests']} requests; median latency {m['latency_ms']:.2f} ms = "
        f"late submit {m['late_submit_ms']:.2f} + wait {m['wait_ms']:.2f} + engine "
        f"{m['engine_ms']:.2f} + resolve {m['resolve_ms']:.2f}"
    )
    classes = ", ".join(f"{c} {n}" for c, n in s["tail_classes"].items() if n)
    print(f"    slowest {len(s['tail'])}: {classes}")
    for r in s["tail"]:
        print(
            f"    #{r['request']:<5} {r['latency_ms']:6.2f} ms: late {r['late_submit_ms']:5.2f}, "
            f"wait {r['wait_ms']:5.2f} (behind a running call {r['behind_ms']:5.2f}), engine "
            f"{r['engine_ms']:5.2f} (batch {r['batch']}), resolve {r['resolve_ms']:5.2f} "
            f"-> {r['class']}"
        )
