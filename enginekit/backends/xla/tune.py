"""Build-time measurement: which layout and which XLA compiler options run a model fastest.

XLA CPU's library fusions (YNNPACK, on by default in jax 0.10) speed some models up and slow
others down, so the build compiles each candidate at the profile's opt shape, times it, and
records every trial plus the winner in the manifest; the engine compiles with the winner.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.backends.xla import program

#: Named sets of per-executable XLA options tried at build time on CPU.
FLAG_SETS: dict[str, dict[str, Any]] = {
    "xla-default": {},
    "ynn-off": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured candidate."""

    layout: str
    flags: str
    ms: float
    compile_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "flags": self.flags,
            "ms": round(self.ms, 4),
            "compile_s": round(self.compile_s, 3),
        }


def time_executable(
    run: Any,
    weights: Sequence[Any],
    arrays: Sequence[np.ndarray],
    budget_s: float = 0.3,
    max_runs: int = 25,
) -> float:
    """Median milliseconds of ``run(weights, arrays)`` after one warm-up call."""
    import jax

    feeds = tuple(arrays)
    with jax.enable_x64(True):
        jax.block_until_ready(run(weights, feeds))
        times: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(times) < 3 or (len(times) < max_runs and time.perf_counter() < deadline):
            start = time.perf_counter()
            jax.block_until_ready(run(weights, feeds))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(
    candidates: Mapping[str, tuple[Any, Sequence[Any]]],
    flag_sets: Mapping[str, Mapping[str, Any]],
    arrays: Sequence[np.ndarray],
    device: Any = None,
) -> list[Trial]:
    """Compile and time every (layout, flag set) pair.

    Args:
        candidates: layout -> (exported program, weights on the device).
        flag_sets: name -> XLA compiler options.
        arrays: the inputs to time with (concrete shapes).
    """
    shapes = [a.shape for a in arrays]
    dtypes = [a.dtype for a in arrays]
    trials = []
    for layout, (exported, weights) in candidates.items():
        for name, options in flag_sets.items():
            run, seconds = program.compile(exported, weights, shapes, dtypes, options, device)
            ms = time_executable(run, weights, arrays)
            trials.append(Trial(layout, name, ms, seconds))
    return trials


def best(trials: Sequence[Trial]) -> Trial:
    """The fastest trial; ties go to the earlier one (defaults are listed first)."""
    return min(trials, key=lambda t: t.ms)
