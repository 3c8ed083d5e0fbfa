"""The bench step of a pipeline run: throughput and latency of every built entry, measured by
:func:`enginekit.evaluate.bench.bench_many`.

It runs after all builds, in one process, never beside a build: engines measured side by side
with other work would slow each other down. ``bench_many`` interleaves its rounds across the
entries, so a burst of noise from elsewhere on the runner hits all of them alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from enginekit.config import ShapeProfile
from enginekit.errors import EnginekitError
from enginekit.pipeline.config import BenchSpec

TOOL = "enginekit.bench"


def default_batch_sizes(profiles: Sequence[Mapping[str, ShapeProfile]]) -> list[int]:
    """The first profile's min, opt and max batch (the leading dim of its first input); [1, 8]
    without profiles. Fewer sizes than ``enginekit bench`` takes by default: CI time is short."""
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
        entry id -> ``{"tool", "stable", "settings", "batches": [enginekit.bench batch results:
        {"batch", "throughput" (samples/s, median of rounds), "round_throughputs",
        "latency_ms": {"p50", "p90", "p99", ...}, "spread", "stable", "split", "error", ...}]}``;
        an entry whose artifact cannot be loaded gets ``{"tool", "error", "batches": []}``.
    """
    from enginekit.backends import load
    from enginekit.evaluate.bench import batched, bench_many

    out: dict[str, dict[str, Any]] = {}
    opened: list[tuple[str, Any]] = []
    try:
        for entry_id, path in artifacts:
            try:
                opened.append((entry_id, load(path)))
            except EnginekitError as exc:
                out[entry_id] = {"tool": TOOL, "error": str(exc), "batches": []}
        if not opened:
            return out
        sizes = spec.batch_sizes or (
            default_batch_sizes(profiles) if batched(opened[0][1]) else None
        )
        results = bench_many(
            [engine for _, engine in opened],
            sizes,
            duration=spec.duration,
            rounds=spec.rounds,
            warmup=spec.warmup,
            labels=[entry_id for entry_id, _ in opened],
        )
    finally:
        for _, engine in opened:
            engine.close()
    for (entry_id, _), result in zip(opened, results):
        data = result.to_json()
        out[entry_id] = {
            "tool": TOOL,
            "stable": data["stable"],
            "settings": data["settings"],
            "peak_rss_mb": data["peak_rss_mb"],
            "batches": data["results"],
        }
    return out


def signature(spec: BenchSpec, profiles: Sequence[Mapping[str, ShapeProfile]] = ()) -> str:
    """What a stored bench result must match to be reused: the bench settings, this host (CPU,
    ISA, CPU count) and the enginekit version. The artifact itself is the cache key."""
    import hashlib
    import json
    import os

    from enginekit import target
    from enginekit.version import __version__

    host = target.host()
    blob = {
        "spec": repr(spec),
        "sizes": default_batch_sizes(profiles),
        "host": [host.get("cpu"), sorted(host.get("isa") or []), os.cpu_count()],
        "enginekit": __version__,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def best(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """Two measurements of one entry merged batch by batch, keeping the faster (for a
    re-measurement of a suspected regression: noise only ever slows a run down)."""
    by_batch = {b["batch"]: b for b in first.get("batches", [])}
    merged = []
    for b in second.get("batches", []):
        a = by_batch.get(b["batch"])
        keep = b if a is None or (b.get("throughput") or 0) > (a.get("throughput") or 0) else a
        merged.append(keep)
    return {**first, "batches": merged, "remeasured": True}
