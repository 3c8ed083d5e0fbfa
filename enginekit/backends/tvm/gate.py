"""Serve a tuned module only where it is faster: each tuned static module is timed against the
dynamic module at its batch, interleaved in one process, and kept out of dispatch unless it
wins by :data:`MARGIN`.

A tuner's gains are per kernel; the static module they land in can still run slower as a whole
than the dynamic one (tv-resnet50 at batch 1: the tuned module 1.03-1.16x slower, quiet
reruns, docs/backends/tvm.md "Tuning"). A user who tunes must never get a slower engine than
without tuning, so the build measures the one thing that decides it: a whole call of each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.errors import BuildError
from enginekit.progress import step

if TYPE_CHECKING:
    from enginekit.config import BuildConfig
    from enginekit.model import Model

log = logging.getLogger(__name__)

#: How much faster (a fraction of the dynamic module's time) a tuned module must be to serve.
MARGIN = 0.02
#: ``tune={"serve": ...}``: "auto" serves a tuned module only when it is faster; "always"
#: serves it untimed (the behaviour before the gate).
SERVE = ("auto", "always")
#: Rounds over the modules, and the seconds of calls each module gets per round.
ROUNDS, ROUND_S = 7, 0.1


def decide(
    tuned_ms: float | None, dynamic_ms: float | None, serve: str = "auto", margin: float = MARGIN
) -> tuple[bool, str]:
    """Whether the tuned module serves its batch, and the decision as the manifest words it.

    Args:
        tuned_ms: the tuned module's median time per call (None: not timed).
        dynamic_ms: the dynamic module's, at the same inputs (None: not timed).
        serve: "always" serves regardless of the times; "auto" only when the tuned module
            takes at most ``(1 - margin)`` of the dynamic module's time.
    """
    if serve == "always":
        return True, "served (serve='always')"
    if tuned_ms is None or dynamic_ms is None:
        return True, "served (not timed: the build's code does not run on this host)"
    if tuned_ms <= (1.0 - margin) * dynamic_ms:
        return (
            True,
            f"served: {dynamic_ms / tuned_ms:.2f}x faster, {tuned_ms:.2f} ms vs {dynamic_ms:.2f}",
        )
    return False, (
        f"not served: dynamic module faster, {tuned_ms:.2f} ms vs {dynamic_ms:.2f}"
        if tuned_ms >= dynamic_ms
        else f"not served: within {margin:.0%} of the dynamic module, {tuned_ms:.2f} ms vs "
        f"{dynamic_ms:.2f}"
    )


def time_calls(calls: Sequence[Any], rounds: int = ROUNDS, round_s: float = ROUND_S) -> list[float]:
    """Median milliseconds per call of each zero-argument callable, run interleaved.

    Each round runs every callable for about ``round_s`` seconds, the order rotated every
    round, so load that comes and goes falls on all of them alike; a callable's time is the
    median of its per-round medians.
    """
    once = []
    for call in calls:  # warm-up: the first call allocates and pages in the weights
        call()
        start = time.perf_counter()
        call()
        once.append(max(time.perf_counter() - start, 1e-5))
    runs = [max(3, min(200, int(round_s / t))) for t in once]
    medians: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        order = list(range(len(calls)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            samples = []
            for _ in range(runs[i]):
                start = time.perf_counter()
                calls[i]()
                samples.append(time.perf_counter() - start)
            medians[i].append(float(np.median(samples)))
    return [1e3 * float(np.median(m)) for m in medians]


def time_against_dynamic(
    dynamic_path: str, static_path: str, args: Sequence[np.ndarray]
) -> tuple[float, float]:
    """(static module's ms, dynamic module's ms) per call on ``args``, timed interleaved."""
    import tvm
    from tvm import relax

    device = tvm.cpu()
    tensors = [tvm.runtime.tensor(a, device) for a in args]
    mains = [
        relax.VirtualMachine(tvm.runtime.load_module(p), device)["main"]
        for p in (static_path, dynamic_path)
    ]
    static_ms, dynamic_ms = time_calls([lambda m=m: m(*tensors) for m in mains])
    return static_ms, dynamic_ms


def _in_new_thread(dynamic_path: str, static_path: str, args: Sequence[np.ndarray]) -> Any:
    """:func:`time_against_dynamic` in a new thread: TVM sizes a thread's pool when it first
    runs there, and a new one gets the engine's count (``runtime.configure_threads``), not
    the count the tuner's runs started the building thread's pool with."""
    from enginekit.backends.tvm.runtime import configure_threads

    configure_threads()
    box: list[Any] = []

    def timed() -> None:
        try:
            box.append(time_against_dynamic(dynamic_path, static_path, args))
        except Exception as exc:  # re-raised in the building thread
            box.append(exc)

    worker = threading.Thread(target=timed)
    worker.start()
    worker.join()
    if isinstance(box[0], Exception):
        raise BuildError(f"timing {Path(static_path).name} failed: {box[0]}") from box[0]
    return box[0]


def serve(
    model: Model,
    config: BuildConfig,
    spec: Any,
    modules: list[dict[str, Any]],
    workdir: Path,
    dynamic: str,
    example: Mapping[str, Any],
    here: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tuned modules that serve their batch, and per batch size both times and the
    decision: a module not faster than the dynamic one is deleted from ``workdir`` (left out
    of the artifact), and the dynamic module serves its batch.

    Args:
        spec: the build's TuneSpec (its ``serve`` and ``margin``).
        modules: the tuned modules' manifest entries (``file``, ``shapes``, ``batch``).
        dynamic: the dynamic module's file name in ``workdir``.
        example: value inputs' values (not the programs' inputs).
        here: whether the built code runs on this host (else nothing is timed: served).
    """
    from enginekit.model import random_feeds

    kept, serving = [], {}
    for i, entry in enumerate(modules):
        batch = str(entry["batch"])
        times: tuple[float | None, float | None] = (None, None)
        if here and spec.serve != "always":
            shapes = {k: tuple(v) for k, v in entry["shapes"].items()}
            feeds = random_feeds(model.inputs, shapes, seed=config.seed + 200 + i)
            args = [feeds[s.name] for s in model.inputs if s.name not in example]
            with step(f"timing {entry['file']} against {dynamic} (batch {batch})"):
                times = _in_new_thread(str(workdir / dynamic), str(workdir / entry["file"]), args)
        served, decision = decide(*times, serve=spec.serve, margin=spec.margin)
        log.info("tvm: tuned batch %s %s", batch, decision)
        serving[batch] = {
            "tuned_ms": None if times[0] is None else round(times[0], 3),
            "dynamic_ms": None if times[1] is None else round(times[1], 3),
            "served": served,
            "decision": decision,
        }
        if served:
            kept.append(entry)
        else:
            (workdir / entry["file"]).unlink(missing_ok=True)
    return kept, serving
