"""``batch_size="auto"``: a short search, with :func:`enginekit.bench` on rows of the real data,
for the largest batch within the engine's profiles and a memory budget that gives the best
throughput. A batch that runs out of memory is halved and retried, and that is recorded."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from enginekit.engine import Engine
from enginekit.errors import UsageError
from enginekit.evaluate.bench import bench, max_batch

#: A batch within this fraction of the best throughput counts as just as good (the largest such
#: one is chosen: fewer, larger calls leave the pipeline more slack).
TOLERANCE = 0.05
#: The largest batch tried on an engine whose profiles do not bound it.
UNBOUNDED_MAX = 1024
#: Copies of one batch alive at once in the pipeline (prefetch queues, the engine, the writer).
COPIES = 8


@dataclasses.dataclass(frozen=True)
class BatchTrial:
    """One measured batch size: rows per second, or why it could not run."""

    batch: int
    rows_per_s: float | None  # the best of ``measured``
    error: str | None = None
    measured: tuple[float, ...] = ()  # rows/s of each short run, in the order they ran

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    """The chosen batch size and how it was chosen."""

    batch_size: int
    trials: tuple[BatchTrial, ...]
    reason: str
    oom_retries: int = 0
    memory_cap: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "reason": self.reason,
            "oom_retries": self.oom_retries,
            "memory_cap": self.memory_cap,
            "trials": [t.to_json() for t in self.trials],
        }


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_memory(value: int | str | None) -> int | None:
    """``"4GiB"``, ``"512MB"``, ``1e9`` or None -> bytes."""
    if value is None or isinstance(value, (int, float)):
        if value is not None and value <= 0:
            raise UsageError(f"max memory must be > 0 bytes, got {value!r}")
        return None if value is None else int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(
            f"max memory {value!r}: expected a size such as 4GiB, 512MB or a number of bytes"
        )
    return parse_memory(int(float(m.group(1)) * _UNITS[unit]))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an error from a backend is an allocation failure (host or device)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(
        s in text
        for s in ("out of memory", "failed to allocate", "cudaerrormemoryallocation",
                  "resource_exhausted", "bad_alloc", "cannot allocate memory")
    )  # fmt: skip


def batch_range(engine: Engine) -> tuple[int, int]:
    """The smallest and largest batch one run of the engine takes without splitting."""
    top = max_batch(engine)
    names = [s.name for s in engine.inputs]
    lows = [
        min(p[n].min[0] for n in names if n in p)
        for p in engine.profiles
        if any(n in p for n in names)
    ]
    return (max(1, min(lows)) if lows else 1), (top if top is not None else UNBOUNDED_MAX)


def row_bytes(sample: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> int:
    """Bytes of one row of inputs and outputs."""
    total = 0
    for a in [*sample.values(), *outputs.values()]:
        total += a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    return max(total, 1)


def default_budget() -> int:
    """A quarter of the machine's memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def choose_batch_size(
    engine: Engine,
    sample: Mapping[str, np.ndarray],
    max_memory: int | None = None,
    *,
    seconds: float = 0.15,
) -> BatchChoice:
    """Measure powers of two across the engine's batch range (and its maximum) on ``sample``'s
    rows, within ``max_memory`` bytes for the pipeline's batches; return the largest batch
    within :data:`TOLERANCE` of the best throughput.

    A short measurement on a shared machine can be slowed by anything else that runs, never
    sped up: so every size gets at least two measurements, taken at different times (a first
    pass up the sizes, then a second pass over all of them, interleaved), and its best one
    counts. The first pass stops past the peak only when a drop is confirmed by measuring that
    size again."""
    lo, hi = batch_range(engine)
    one = engine.infer({k: v[:lo] for k, v in sample.items()} if len(sample) else sample)
    budget = max_memory or default_budget()
    per_row = row_bytes(sample, one)
    cap = max(lo, budget // (COPIES * per_row))
    top = min(hi, cap)
    sizes = sorted({lo, top} | {1 << i for i in range(16) if lo <= 1 << i <= top})
    half = seconds / 2
    errors: dict[int, str] = {}
    measured: dict[int, list[float]] = {}
    oom = 0
    best = 0.0

    def measure(b: int) -> float | None:
        result = bench(engine, [b], duration=half, warmup=0.02, rounds=1, data=dict(sample))
        r = result.results[0]
        if r.error is not None:
            errors[b] = r.error
            return None
        assert r.throughput is not None
        measured.setdefault(b, []).append(r.throughput)
        return r.throughput

    for b in sizes:
        rate = measure(b)
        if rate is None:
            if is_out_of_memory_text(errors[b]):
                oom += 1
                break  # larger ones will not fit either: the search stops at the memory limit
            continue
        best = max(best, rate)
        # Past the peak by a margin (and still so when measured again): larger batches only
        # cost memory and latency.
        if rate < 0.7 * best and (measure(b) or 0.0) < 0.7 * best:
            break
    # The second pass, largest first: what the first pass saw slowed is measured again at
    # another time.
    for b in sorted(measured, reverse=True):
        if len(measured[b]) < 2:
            measure(b)
    trials = [
        BatchTrial(b, max(measured[b]), measured=tuple(measured[b]))
        if b in measured
        else BatchTrial(b, None, _trial_error(errors[b]))
        for b in sorted({*measured, *errors})
    ]
    good = [t for t in trials if t.rows_per_s is not None]
    if not good:
        return BatchChoice(lo, tuple(trials), "no batch size ran; using the smallest", oom, cap)
    best = max(t.rows_per_s or 0.0 for t in good)
    chosen = max(t.batch for t in good if (t.rows_per_s or 0.0) >= (1 - TOLERANCE) * best)
    limit = "memory budget" if cap < hi else "largest profile batch"
    reason = (
        f"largest batch within {TOLERANCE:.0%} of the best measured throughput "
        f"({best:.0f} rows/s, the best of two or more short runs per size) in {lo}..{top} "
        f"({limit} {top})"
    )
    return BatchChoice(chosen, tuple(trials), reason, oom, cap)


def is_out_of_memory_text(error: str) -> bool:
    """Whether a bench error text (see :func:`enginekit.evaluate.bench.bench`) is an allocation
    failure."""
    return "memory" in error.lower() or "allocate" in error.lower()


def _trial_error(error: str) -> str:
    return f"out of memory: {error}" if is_out_of_memory_text(error) else error
