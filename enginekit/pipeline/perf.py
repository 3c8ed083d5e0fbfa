"""The bench step of a pipeline run: throughput and latency of every built entry.

One function, :func:`measure`. It runs after all builds, in one process, entries one after
another (never in parallel: engines measured side by side would slow each other down).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import ShapeProfile
from enginekit.pipeline.config import BenchSpec


def default_batch_sizes(profiles: Sequence[Mapping[str, ShapeProfile]]) -> list[int]:
    """The first profile's min, opt and max batch (leading dim of its first input); [1, 8]
    without profiles."""
    if not profiles or not profiles[0]:
        return [1, 8]
    prof = next(iter(profiles[0].values()))
    if not prof.min:
        return [1]
    return sorted({max(1, prof.min[0]), prof.opt[0], prof.max[0]})


def measure(
    artifacts: Sequence[tuple[str, str]],
    spec: BenchSpec,
    profiles: Sequence[Mapping[str, ShapeProfile]] = (),
) -> dict[str, dict[str, Any]]:
    """Benchmark every ``(entry id, artifact path)`` at each batch size.

    Returns:
        entry id -> ``{"tool", "batches": [{"batch", "throughput" (samples/s), "latency_ms":
        {"p50", "p90", "p99"}, "stable", "spread", "error"}]}``.
    """
    import enginekit as ek

    sizes = list(spec.batch_sizes or default_batch_sizes(profiles))
    out: dict[str, dict[str, Any]] = {}
    for entry_id, path in artifacts:
        with ek.load(path) as engine:
            out[entry_id] = {
                "tool": "timed-loop",
                "batches": [_timed(engine, b, spec) for b in sizes],
            }
    return out


def _feeds(engine: Any, batch: int) -> dict[str, np.ndarray]:
    from enginekit.model import random_feeds

    profile = engine.profiles[0] if engine.profiles else {}
    shapes = {}
    for s in engine.inputs:
        if s.name in profile:
            base = list(profile[s.name].opt)
        else:
            base = [d if isinstance(d, int) else 1 for d in s.shape]
        if base and not isinstance(s.shape[0], int):
            base[0] = batch
        shapes[s.name] = tuple(base)
    return random_feeds(engine.inputs, shapes)


def _timed(engine: Any, batch: int, spec: BenchSpec) -> dict[str, Any]:
    """A minimal timed loop, until enginekit.bench is available to this module."""
    try:
        feeds = _feeds(engine, batch)
        engine.infer(feeds)
    except Exception as exc:
        return {"batch": batch, "throughput": None, "error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter() + spec.warmup
    while time.perf_counter() < end:
        engine.infer(feeds)
    times: list[float] = []
    rates = []
    per_round = spec.duration / spec.rounds
    for _ in range(spec.rounds):
        calls = 0
        start = time.perf_counter()
        stop = start + per_round
        while True:
            t0 = time.perf_counter()
            engine.infer(feeds)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            calls += 1
            if t1 >= stop:
                break
        rates.append(calls * batch / (t1 - start))
    median = float(np.median(rates))
    spread = (max(rates) - min(rates)) / median if len(rates) > 1 and median else None
    ms = np.asarray(times) * 1e3
    return {
        "batch": batch,
        "throughput": median,
        "latency_ms": {
            "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)),
        },
        "runs": len(times),
        "spread": spread,
        "stable": None if spread is None else spread <= 0.10,
        "error": None,
    }
