"""What a Batcher's arguments default to, and how they are checked: the largest batch the engine's
profiles accept, the engine's padding buckets as preferred sizes, as many workers as calls the
engine runs at once, a warm-up run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

import numpy as np

from enginekit.batcher.policy import pow2_sizes
from enginekit.engine import Engine
from enginekit.errors import UsageError

DEFAULT_MAX_BATCH = 32  # for engines built without profiles (any batch size)


def engine_max_batch(engine: Engine) -> int | None:
    """The most rows one profile of ``engine`` accepts for every input; None without profiles."""
    names = [s.name for s in engine.inputs]
    if not engine.profiles or not all(n in p for p in engine.profiles for n in names):
        return None
    return max(min(p[n].max[0] for n in names) for p in engine.profiles)


def default_preferred(engine: Engine, max_batch: int) -> tuple[int, ...]:
    """Batch sizes the engine runs without padding waste, where it pads others (XLA buckets)."""
    backend = engine.manifest.get("backend", {})
    if backend.get("name") == "xla" and backend.get("metadata", {}).get("buckets") == "pow2":
        return pow2_sizes(max_batch)
    return ()


def preferred_for(
    engine: Engine, preferred_sizes: Sequence[int] | str, max_batch: int
) -> tuple[int, ...]:
    """The ``preferred_sizes`` argument checked, with "auto" resolved for ``engine``."""
    if isinstance(preferred_sizes, str):
        if preferred_sizes != "auto":
            raise UsageError(
                f"preferred_sizes={preferred_sizes!r}: expected 'auto' or a list of sizes"
            )
        return default_preferred(engine, max_batch)
    preferred = tuple(sorted({int(p) for p in preferred_sizes}))
    bad = [p for p in preferred if not 1 <= p <= max_batch]
    if bad:
        raise UsageError(f"preferred_sizes {bad}: each must lie in 1..max_batch_size ({max_batch})")
    return preferred


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


def engine_concurrency(engine: Engine) -> int:
    """How many ``infer`` calls ``engine`` runs at once without one waiting for another, as its
    build reports it: an OpenVINO engine's CPU streams; an ONNX Runtime CPU engine built with a
    fixed ``intra_op_threads`` (sequential execution) fits ``cores // intra_op_threads`` calls
    side by side. 1 for everything else: an engine that already spreads one call over every
    core (ONNX Runtime's default), a GPU engine, or one that says nothing."""
    backend = engine.manifest.get("backend") or {}
    metadata = backend.get("metadata") or {}
    options = (engine.manifest.get("config") or {}).get("options") or {}
    name = backend.get("name")
    try:
        if name == "openvino":
            return max(1, int(metadata.get("streams", 1)))
        if name == "onnxruntime" and metadata.get("providers") == ["CPUExecutionProvider"]:
            threads = int(options.get("intra_op_threads", 0))
            if threads > 0 and options.get("execution_mode", "sequential") == "sequential":
                return max(1, usable_cores() // threads)
    except (TypeError, ValueError):  # a hand-written manifest: no claim to act on
        return 1
    return 1


def workers_for(engine: Engine, workers: int | str) -> int:
    """The ``workers`` argument checked, with "auto" resolved for ``engine``."""
    if isinstance(workers, str):
        if workers != "auto":
            raise UsageError(f"workers={workers!r}: expected 'auto' or a positive integer")
        return engine_concurrency(engine)
    positive("workers", workers, integer=True)
    return workers


def standby_for(engine: Engine, standby: int | str, workers: int) -> int:
    """The ``standby`` argument checked, with "auto" resolved for ``engine``: the calls the
    engine runs side by side beyond the ``workers`` already running them."""
    if isinstance(standby, str):
        if standby != "auto":
            raise UsageError(f"standby={standby!r}: expected 'auto' or a count >= 0")
        return max(engine_concurrency(engine) - workers, 0)
    if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
        raise UsageError(f"standby={standby!r}: expected 'auto' or a count >= 0")
    return standby


def positive(name: str, value: float, integer: bool = False) -> None:
    """Raise UsageError naming ``name`` unless ``value`` is a positive number (or integer)."""
    if (integer and (isinstance(value, bool) or not isinstance(value, int))) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise UsageError(f"{name}={value!r}: expected {kind}")


def run_warmup(engine: Engine, max_batch: int) -> Iterator[tuple[int, float]]:
    """Run ``engine`` on zeros at batch 1 and ``max_batch``, twice; yields (rows, seconds)."""
    feeds_for = {}
    profile = engine.profiles[0] if engine.profiles else {}
    for s in engine.inputs:
        if s.name in profile:
            dims = profile[s.name].opt[1:]
        elif all(isinstance(d, int) for d in s.shape[1:]):
            dims = tuple(int(d) for d in s.shape[1:])
        else:
            raise UsageError(
                f"warmup: input {s.name!r} has free dims {s.shape} and the engine no "
                "profile to pick sizes from; submit a few requests instead"
            )
        feeds_for[s.name] = (np.dtype(s.dtype), dims)
    for rows in (1, max_batch, 1, max_batch):
        feeds = {n: np.zeros((rows, *dims), dt) for n, (dt, dims) in feeds_for.items()}
        start = time.perf_counter()
        engine.infer(feeds)
        yield rows, time.perf_counter() - start
