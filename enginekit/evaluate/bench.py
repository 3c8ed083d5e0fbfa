"""``bench``: latency percentiles and throughput of engines, per batch size, with noise handling.

For every engine and batch size: a warm-up, then timed ``infer`` calls in several rounds until a
duration or a run count is spent. Rounds are interleaved across batch sizes and engines, so a
burst of noise from elsewhere on the machine hits all of them rather than one; the report gives
the median throughput over rounds, the spread between rounds, and flags results whose spread
exceeds a threshold as unstable. Latency percentiles pool every timed call. When another
engine takes over, its round starts :data:`SETTLE_S` after the last one's calls, so that the
idle threads the last engine leaves spinning (ONNX Runtime's, ~50 ms) are not timed with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.engine import Engine
from enginekit.errors import EnginekitError, UsageError
from enginekit.evaluate.machine import host_info, peak_rss_mb, reset_peak_rss, versions
from enginekit.evaluate.report import BatchResult, BenchResult, Latency
from enginekit.model import concrete_shapes, random_feeds

#: Relative spread of round throughputs, (max - min) / median, above which a result is unstable.
UNSTABLE_SPREAD = 0.10


# -- timing --------------------------------------------------------------------------------------


def time_calls(fn: Callable[[], Any], budget_s: float | None, max_runs: int | None) -> np.ndarray:
    """Call ``fn`` until ``budget_s`` seconds pass or ``max_runs`` calls are made (whichever
    first; at least one call); returns each call's seconds."""
    times: list[float] = []
    deadline = time.perf_counter() + budget_s if budget_s is not None else math.inf
    while True:
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        times.append(end - start)
        if (max_runs is not None and len(times) >= max_runs) or end >= deadline:
            return np.asarray(times)


def warm_up(fn: Callable[[], Any], seconds: float) -> None:
    """At least one call (a JIT backend compiles there), then more until ``seconds`` pass."""
    time_calls(fn, seconds, None if seconds > 0 else 1)


def latency(seconds: np.ndarray) -> Latency:
    """Percentiles of per-call seconds, in milliseconds."""
    ms = seconds * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return Latency(
        float(p50), float(p90), float(p99), float(ms.max()), float(ms.min()), float(ms.mean())
    )


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median of per-round values; None for fewer than two rounds."""
    if len(values) < 2:
        return None
    med = float(np.median(values))
    return (max(values) - min(values)) / med if med > 0 else math.inf


# -- inputs --------------------------------------------------------------------------------------


def batched(engine: Engine) -> bool:
    """Whether every input's leading dim is one shared symbolic (batch) dim."""
    first = [s.shape[0] if s.shape else None for s in engine.inputs]
    return bool(first) and isinstance(first[0], str) and all(d == first[0] for d in first)


def max_batch(engine: Engine) -> int | None:
    """The largest batch one run of the engine takes (None: unbounded or not batched)."""
    names = [s.name for s in engine.inputs]
    if not batched(engine) or not engine.profiles:
        return None
    if not all(n in p for p in engine.profiles for n in names):
        return None
    return max(min(p[n].max[0] for n in names) for p in engine.profiles)


def _shapes_for(engine: Engine, batch: int) -> dict[str, tuple[int, ...]]:
    if not batched(engine):
        fixed = {s.shape[0] for s in engine.inputs if s.shape}
        if fixed != {batch}:
            raise UsageError(
                f"this engine has no batch dim (inputs {', '.join(map(str, engine.inputs))}); "
                f"it runs only its own shapes, not batch {batch}"
            )
        return concrete_shapes(engine.inputs, None, batch=batch)
    names = [s.name for s in engine.inputs]
    fits = [
        p
        for p in engine.profiles
        if all(n in p and p[n].min[0] <= batch <= p[n].max[0] for n in names)
    ]
    profile = fits[0] if fits else (engine.profiles[0] if engine.profiles else None)
    shapes = concrete_shapes(engine.inputs, profile, "opt", batch=batch)
    return {n: (batch, *s[1:]) for n, s in shapes.items()}


def _tile(data: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """User data repeated or cut along the batch dim to ``batch`` rows."""
    out = {}
    for name, a in data.items():
        a = np.asarray(a)
        if a.ndim == 0 or a.shape[0] == 0:
            raise UsageError(f"bench data {name!r}: needs at least one row, got shape {a.shape}")
        out[name] = np.take(a, np.arange(batch) % a.shape[0], axis=0)
    return out


# -- bench -----------------------------------------------------------------------------------------

EngineLike = Engine | str | os.PathLike


def check_settings(
    batch_sizes: Sequence[int] | None,
    duration: float | None,
    runs: int | None,
    warmup: float,
    rounds: int,
) -> None:
    """Refuse benchmark settings that cannot produce a measurement.

    Raises:
        UsageError: zero or negative duration, runs or rounds; neither duration nor runs;
            an empty or non-positive batch size list; a negative warm-up.
    """
    if duration is None and runs is None:
        raise UsageError("bench needs a duration (seconds) or a run count; both are None")
    if duration is not None and not (isinstance(duration, (int, float)) and duration > 0):
        raise UsageError(f"bench duration must be > 0 seconds, got {duration!r}")
    if duration is not None and not math.isfinite(duration):
        raise UsageError(f"bench duration must be finite, got {duration!r}")
    if runs is not None and not (isinstance(runs, int) and not isinstance(runs, bool) and runs > 0):
        raise UsageError(f"bench runs must be a positive integer, got {runs!r}")
    if not (isinstance(rounds, int) and rounds >= 1):
        raise UsageError(f"bench rounds must be an integer >= 1, got {rounds!r}")
    if not (isinstance(warmup, (int, float)) and 0 <= warmup < math.inf):
        raise UsageError(f"bench warm-up must be >= 0 seconds, got {warmup!r}")
    if batch_sizes is not None:
        if not batch_sizes:
            raise UsageError("bench batch sizes: the list is empty")
        bad = [b for b in batch_sizes if not isinstance(b, (int, np.integer)) or b < 1]
        if bad:
            raise UsageError(f"bench batch sizes must be integers >= 1, got {bad}")


def default_batch_sizes(engine: Engine) -> list[int]:
    """Powers of two across the first profile's batch range, plus its min, opt and max."""
    if not batched(engine):
        first = engine.inputs[0].shape[0] if engine.inputs and engine.inputs[0].shape else 1
        return [first if isinstance(first, int) else 1]
    if not engine.profiles:
        return [1, 8]
    p = engine.profiles[0][engine.inputs[0].name]
    lo, opt, hi = p.min[0], p.opt[0], p.max[0]
    sizes = {lo, opt, hi} | {1 << i for i in range(12) if lo <= 1 << i <= hi}
    return sorted(s for s in sizes if s >= 1)


def describe_engine(engine: Engine, label: str | None = None, path: Any = None) -> dict[str, Any]:
    """The engine facts a report records: backend, version, precision, profiles, build key."""
    m = engine.manifest
    backend = m.get("backend", {})
    name = str(backend.get("name", type(engine).__name__))
    precision = str(m.get("precision", "fp32"))
    return {
        "label": label or (Path(str(path)).name if path is not None else f"{name} {precision}"),
        "backend": name,
        "version": backend.get("version"),
        "metadata": dict(backend.get("metadata", {})),
        "precision": precision,
        "device": m.get("config", {}).get("device", "cpu"),
        "options": dict(m.get("config", {}).get("options", {})),
        "profiles": m.get("profiles", []),
        "build_key": m.get("build_key"),
        "path": None if path is None else str(path),
        "source": m.get("source", {}).get("path"),
    }


@dataclasses.dataclass
class _Job:
    """Mutable state of one (engine, batch size) while rounds run."""

    batch: int
    feeds: dict[str, np.ndarray] | None = None
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    times: list[np.ndarray] = dataclasses.field(default_factory=list)
    peak: float | None = None
    error: str | None = None
    extra: int = 0  # rounds added to settle an unstable result


def bench(
    engine: EngineLike,
    batch_sizes: Sequence[int] | None = None,
    *,
    duration: float | None = 1.0,
    runs: int | None = None,
    warmup: float = 0.2,
    rounds: int = 3,
    data: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    label: str | None = None,
    unstable_spread: float = UNSTABLE_SPREAD,
    stabilize: bool = True,
) -> BenchResult:
    """Benchmark one engine at each batch size.

    Args:
        engine: an Engine, or the path of an artifact to load (and close afterwards).
        batch_sizes: rows per call (default: powers of two across the first profile's range).
            Sizes above the largest profile are split into several runs (flagged ``split``).
        duration: timed seconds per batch size, shared across rounds; with ``runs`` too, each
            round stops at whichever comes first.
        runs: timed calls per batch size, split across the rounds (exactly ``runs`` in all).
        warmup: seconds of untimed calls per batch size before the first round (at least one).
        rounds: timed rounds; the report gives their median throughput and spread.
        data: inputs to use (rows repeated or cut to each batch size) instead of random ones.
        seed: seed of the random inputs.
        label: the engine's name in reports and plots.
        unstable_spread: round-to-round spread above which a result is flagged unstable.
        stabilize: with a duration (not ``runs``), re-measure an unstable result with more
            rounds, one at a time, until its last ``rounds`` rounds agree or the time cap (the
            planned duration again) is spent; the result says how many extra rounds it took.

    Raises:
        UsageError: settings that cannot measure anything (zero duration or runs, no sizes).
    """
    return bench_many(
        [engine],
        batch_sizes,
        duration=duration,
        runs=runs,
        warmup=warmup,
        rounds=rounds,
        data=data,
        seed=seed,
        labels=[label] if label else None,
        unstable_spread=unstable_spread,
        stabilize=stabilize,
    )[0]


def bench_many(
    engines: Sequence[EngineLike],
    batch_sizes: Sequence[int] | None = None,
    *,
    duration: float | None = 1.0,
    runs: int | None = None,
    warmup: float = 0.2,
    rounds: int = 3,
    data: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    labels: Sequence[str] | None = None,
    unstable_spread: float = UNSTABLE_SPREAD,
    stabilize: bool = True,
) -> list[BenchResult]:
    """:func:`bench` for several engines, their rounds interleaved so that they share the
    machine's noise alike; one BenchResult per engine, in order."""
    check_settings(batch_sizes, duration, runs, warmup, rounds)
    if not engines:
        raise UsageError("bench needs at least one engine")
    if labels is not None and len(labels) != len(engines):
        raise UsageError(f"{len(labels)} labels for {len(engines)} engines")
    opened: list[Engine] = []
    owned: list[Engine] = []
    try:
        for e in engines:
            if isinstance(e, Engine):
                opened.append(e)
            else:
                from enginekit.backends import load

                opened.append(load(e))
                owned.append(opened[-1])
        return _bench_opened(
            opened, engines, batch_sizes, duration, runs, warmup, rounds, data, seed, labels,
            unstable_spread, stabilize,
        )  # fmt: skip
    finally:
        for e in owned:
            e.close()


def _bench_opened(
    opened: list[Engine],
    given: Sequence[EngineLike],
    batch_sizes: Sequence[int] | None,
    duration: float | None,
    runs: int | None,
    warmup: float,
    rounds: int,
    data: Mapping[str, np.ndarray] | None,
    seed: int,
    labels: Sequence[str] | None,
    unstable_spread: float,
    stabilize: bool,
) -> list[BenchResult]:
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = host_info()
    start_peak = peak_rss_mb()
    jobs = [[_Job(int(b)) for b in (batch_sizes or default_batch_sizes(e))] for e in opened]
    for engine, engine_jobs in zip(opened, jobs):
        for job in engine_jobs:
            _prepare(engine, job, data, seed, warmup)
    budget = duration / rounds if duration is not None else None
    # exactly `runs` calls: the first rounds take one more when they do not divide evenly
    split = [runs // rounds + (i < runs % rounds) for i in range(rounds)] if runs else None
    turns = _Turns()
    for i in range(rounds):
        for engine, engine_jobs in zip(opened, jobs):
            for job in engine_jobs:
                if job.error is None and (split is None or split[i] > 0):
                    turns.take(engine)
                    _round(engine, job, budget, split[i] if split else None)
    planned = (duration or 0) * sum(len(j) for j in jobs)
    cap = planned if stabilize and runs is None and rounds > 1 else 0
    if cap:
        _stabilize(opened, jobs, budget, rounds, unstable_spread, cap, turns)
    settings = {
        "duration_s": duration,
        "runs": runs,
        "warmup_s": warmup,
        "rounds": rounds,
        "unstable_spread": unstable_spread,
        "stabilize_cap_s": cap or None,
        "seed": seed,
        "data": "user" if data is not None else "random",
    }
    out = []
    for i, (engine, engine_jobs) in enumerate(zip(opened, jobs)):
        path = None if isinstance(given[i], Engine) else given[i]
        results = tuple(_result(engine, job, unstable_spread, rounds) for job in engine_jobs)
        peaks = [r.peak_rss_mb for r in results if r.peak_rss_mb is not None]
        out.append(
            BenchResult(
                engine=describe_engine(engine, labels[i] if labels else None, path),
                results=results,
                settings=settings,
                host=host,
                versions=versions(),
                peak_rss_mb=max([*peaks, start_peak or 0.0]) or None,
                created=created,
            )
        )
    return out


def _prepare(
    engine: Engine, job: _Job, data: Mapping[str, np.ndarray] | None, seed: int, warmup: float
) -> None:
    try:
        job.shapes = _shapes_for(engine, job.batch)
        job.feeds = (
            _tile(data, job.batch)
            if data is not None
            else random_feeds(engine.inputs, job.shapes, seed=seed)
        )
        job.shapes = {k: tuple(v.shape) for k, v in job.feeds.items()}
        feeds = job.feeds
        reset_peak_rss()
        warm_up(lambda: engine.infer(feeds), warmup)
        job.peak = peak_rss_mb()
    except Exception as exc:  # e.g. a batch below the profile's minimum: recorded, not fatal
        job.error = _error_text(exc)


def _stabilize(
    opened: list[Engine],
    jobs: list[list[_Job]],
    budget: float | None,
    rounds: int,
    unstable_spread: float,
    cap: float,
    turns: _Turns,
) -> None:
    """More rounds, one at a time, for the results whose last ``rounds`` rounds still differ
    by more than ``unstable_spread``, until none does or ``cap`` seconds are spent."""
    deadline = time.perf_counter() + cap
    while time.perf_counter() < deadline:
        todo = [
            (engine, job)
            for engine, engine_jobs in zip(opened, jobs)
            for job in engine_jobs
            if job.error is None and (_spread_of(job, rounds) or 0.0) > unstable_spread
        ]
        if not todo:
            return
        for engine, job in todo:
            turns.take(engine)
            _round(engine, job, budget, None)
            job.extra += 1


def _spread_of(job: _Job, rounds: int) -> float | None:
    return spread([job.batch * len(t) / float(t.sum()) for t in job.times[-rounds:]])


#: Seconds between one engine's round and another's: ONNX Runtime's default session keeps its
#: idle intra-op threads spinning for 50-100 ms after each call (ResNet-50 on 2 cores: one core
#: at 100% for 45-50 ms, then idle; benchmarks/peer.py saw up to 100), and an engine timed
#: meanwhile shares the cores with them (TVM's batch-1 CNN read 26-28 ms right after ORT's
#: round against 11-20 ms alone).
SETTLE_S = 0.1


class _Turns:
    """Which engine ran the last round; waits :data:`SETTLE_S` when another one takes over."""

    def __init__(self) -> None:
        self.last: Engine | None = None

    def take(self, engine: Engine) -> None:
        if self.last is not None and self.last is not engine:
            _settle()
        self.last = engine


def _settle() -> None:
    time.sleep(SETTLE_S)


def _round(engine: Engine, job: _Job, budget: float | None, per_round: int | None) -> None:
    feeds = job.feeds
    call = lambda: engine.infer(feeds)  # noqa: E731
    try:
        call()  # one untimed call: caches were just used by another engine or batch size
        reset_peak_rss()
        job.times.append(time_calls(call, budget, per_round))
    except Exception as exc:  # a backend's runtime failure is this batch size's result
        job.error = _error_text(exc)
        return
    peak = peak_rss_mb()
    if peak is not None:
        job.peak = peak if job.peak is None else max(job.peak, peak)


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, EnginekitError) else f"{type(exc).__name__}: {exc}"


def _result(engine: Engine, job: _Job, unstable_spread: float, window: int) -> BatchResult:
    if job.error is not None or not job.times:
        return BatchResult(job.batch, job.shapes, error=job.error or "not run")
    kept = job.times[-window:]  # after extra rounds: the last `rounds` of them
    rounds = tuple(job.batch * len(t) / float(t.sum()) for t in kept)
    pooled = np.concatenate(kept)
    s = spread(rounds)
    stable = None if s is None else s <= unstable_spread
    top = max_batch(engine)
    split = top is not None and job.batch > top
    notes = []
    if split:
        parts = math.ceil(job.batch / top)  # type: ignore[operator]
        notes.append(
            f"above the engine's largest profile batch {top}: each call ran as {parts} split runs"
        )
    if stable is False:
        notes.append(f"unstable: rounds differ by {s:.0%} (> {unstable_spread:.0%})")
        if job.extra:
            notes.append(f"still after {job.extra} extra rounds (time cap reached)")
    elif job.extra:
        notes.append(f"stable after {job.extra} extra rounds")
    return BatchResult(
        batch=job.batch,
        shapes=job.shapes,
        runs=len(pooled),
        latency_ms=latency(pooled),
        throughput=float(np.median(rounds)),
        round_throughputs=rounds,
        spread=s,
        stable=stable,
        split=split,
        peak_rss_mb=job.peak,
        note="; ".join(notes),
        extra_rounds=job.extra,
    )


def plot(results: Sequence[BenchResult], path: str | os.PathLike) -> Path:
    """Write a PNG of throughput and p99 latency vs batch size, one line per engine
    (see :func:`enginekit.evaluate.plot.bench_plot`)."""
    from enginekit.evaluate.plot import bench_plot

    return bench_plot(results, path)
