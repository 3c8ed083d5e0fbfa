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


def _call_s(run: Any, weights: Sequence[Any], feeds: tuple[np.ndarray, ...]) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(run(weights, feeds))
    return time.perf_counter() - start


def measure(
    candidates: Mapping[str, tuple[Any, Sequence[Any]]],
    flag_sets: Mapping[str, Mapping[str, Any]],
    arrays: Sequence[np.ndarray],
    device: Any = None,
    budget_s: float = 2.0,
    rounds: int = 5,
) -> list[Trial]:
    """Compile every (layout, flag set) pair, then time them round-robin.

    Timing in interleaved rounds (each round runs every candidate) and taking each one's median
    keeps a load spike on a shared machine from deciding the winner.

    Args:
        candidates: layout -> (exported program, weights on the device).
        flag_sets: name -> XLA compiler options.
        arrays: the inputs to time with (concrete shapes).
        budget_s: rough total seconds of timed runs across all candidates.
    """
    import jax

    shapes = [a.shape for a in arrays]
    dtypes = [a.dtype for a in arrays]
    feeds = tuple(arrays)
    compiled = []
    for layout, (exported, weights) in candidates.items():
        for name, options in flag_sets.items():
            run, seconds = program.compile(exported, weights, shapes, dtypes, options, device)
            compiled.append((layout, name, run, weights, seconds))
    samples: list[list[float]] = [[] for _ in compiled]
    with jax.enable_x64(True):
        warm = [min(_call_s(run, w, feeds), _call_s(run, w, feeds)) for _, _, run, w, _ in compiled]
        per_round = budget_s / rounds / len(compiled)
        reps = [max(1, min(50, int(per_round / max(t, 1e-6)))) for t in warm]
        for _ in range(rounds):
            for i, (_, _, run, weights, _) in enumerate(compiled):
                start = time.perf_counter()
                for _ in range(reps[i]):
                    jax.block_until_ready(run(weights, feeds))
                samples[i].append((time.perf_counter() - start) / reps[i])
    return [
        Trial(layout, name, statistics.median(samples[i]) * 1e3, seconds)
        for i, (layout, name, _, _, seconds) in enumerate(compiled)
    ]


def best(trials: Sequence[Trial]) -> Trial:
    """The fastest trial; ties go to the earlier one (defaults are listed first)."""
    return min(trials, key=lambda t: t.ms)


def rows_independent(
    exported: Any,
    weights: Sequence[Any],
    arrays: Sequence[np.ndarray],
    options: Mapping[str, Any],
    device: Any = None,
    seed: int = 0,
) -> bool:
    """Whether padding a batch can change the real rows' results.

    Runs one program twice on batches that differ only in their last row; the other rows'
    outputs must not move. A model whose rows interact (a reduction over the batch, batch
    statistics) fails this, and then gets one program per batch size instead of padding.
    """
    import jax

    shapes = [a.shape for a in arrays]
    run, _ = program.compile(exported, weights, shapes, [a.dtype for a in arrays], options, device)
    rng = np.random.default_rng(seed)
    other = [a.copy() for a in arrays]
    for a in other:
        if a.dtype.kind == "f":
            a[-1] = rng.standard_normal(a.shape[1:]).astype(a.dtype) * 3
        elif a.dtype.kind == "b":
            a[-1] = ~a[-1]
        else:
            a[-1] = (a[-1] + 1) % 2  # random_feeds gives 0/1 integers (valid ids and masks)
    with jax.enable_x64(True):
        first = [np.asarray(o) for o in run(weights, tuple(arrays))]
        second = [np.asarray(o) for o in run(weights, tuple(other))]
    return all(
        np.allclose(a[:-1], b[:-1], rtol=1e-5, atol=1e-6, equal_nan=True)
        for a, b in zip(first, second)
    )
