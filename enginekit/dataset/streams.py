"""``streams``: concurrent engine calls in a dataset job, and the measured choice of ``"auto"``.

One engine call that spreads over every core loses the whole call whenever a reader or writer
thread takes one of those cores (the other threads of a parallel operator wait for the
straggler), and its idle threads spin on the cores the reader needs. Several calls in flight,
each on fewer threads (``threads`` at load, :func:`enginekit.load`), share the cores without
that barrier. Which configuration is faster depends on the model and the host, so ``"auto"``
measures them on rows of the real data, as ``batch_size="auto"`` does.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from enginekit.engine import Engine
from enginekit.errors import UsageError

#: More streams within this fraction of the best measured throughput win: the search runs the
#: engine alone, and in a job independent calls tolerate the reader's and writer's CPU better
#: (benchmarks/dataset.py, 2 cores: one call on both cores kept 0.6-0.8 of its in-memory rate
#: in the job, one-thread streams about 1.0), so one call must be clearly faster alone to win.
TOLERANCE = 0.1
#: The most streams a job runs (a bound on threads and on batches in flight).
MAX_STREAMS = 64
#: The longest wait between the engine's measurement and the next configuration's, for its
#: idle threads to stop spinning (as ``enginekit.evaluate.bench.SETTLE_S`` between engines).
SETTLE_S = 0.1
#: The wait ends at the first :data:`SETTLE_WINDOW_S` in which the process used less than
#: :data:`SETTLE_BUSY` of one core (ONNX Runtime's spinning thread: 80-120%, for 40-50 ms).
SETTLE_WINDOW_S = 0.01
SETTLE_BUSY = 0.3


@dataclasses.dataclass(frozen=True)
class StreamTrial:
    """One measured configuration: ``streams`` concurrent calls of ``threads`` threads each
    (None: the engine's own threading)."""

    streams: int
    threads: int | None
    rows_per_s: float | None  # the best of ``measured``
    error: str | None = None
    measured: tuple[float, ...] = ()  # rows/s of each round, in the order they ran
    rows_per_cpu_s: tuple[float, ...] = ()  # rows per CPU-second of each round

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StreamChoice:
    """The chosen streams and threads per call, and how they were chosen."""

    streams: int
    threads: int | None
    trials: tuple[StreamTrial, ...]
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "threads": self.threads,
            "reason": self.reason,
            "trials": [t.to_json() for t in self.trials],
        }


def cores() -> int:
    """CPUs this process may run on (its affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_streams(streams: int | str) -> None:
    """Refuse anything but ``"auto"`` or an integer in 1..MAX_STREAMS."""
    ok = streams == "auto" or (
        isinstance(streams, int) and not isinstance(streams, bool) and 1 <= streams <= MAX_STREAMS
    )
    if not ok:
        raise UsageError(
            f"streams must be 'auto' or an integer in 1..{MAX_STREAMS}, got {streams!r}"
        )


def settle(limit: float | None = None) -> float:
    """Wait until no thread of this process is spinning (a window of :data:`SETTLE_WINDOW_S`
    with less than :data:`SETTLE_BUSY` of a core used), at most ``limit`` seconds (default
    :data:`SETTLE_S`); returns the seconds waited. An engine whose threads do not spin costs
    one window, not the whole limit (every ``streams="auto"`` job waits once per round)."""
    limit = SETTLE_S if limit is None else limit
    start = time.perf_counter()
    for _ in range(max(1, round(limit / SETTLE_WINDOW_S))):
        cpu, t = time.process_time(), time.perf_counter()
        time.sleep(SETTLE_WINDOW_S)
        if time.process_time() - cpu < SETTLE_BUSY * (time.perf_counter() - t):
            break
    return time.perf_counter() - start


def threads_per_stream(streams: int, available: int | None = None) -> int:
    """Threads each of ``streams`` concurrent calls gets when the cores are split evenly."""
    return max(1, (available or cores()) // streams)


def rate(engine: Engine, sample: Mapping[str, np.ndarray], batch: int, streams: int,
         seconds: float) -> float:  # fmt: skip
    """Rows/s of ``streams`` threads calling the engine on ``batch`` rows for ``seconds``."""
    return rate_and_cpu(engine, sample, batch, streams, seconds)[0]


def rate_and_cpu(engine: Engine, sample: Mapping[str, np.ndarray], batch: int, streams: int,
                 seconds: float) -> tuple[float, float]:  # fmt: skip
    """Rows/s of ``streams`` threads calling the engine on ``batch`` rows for ``seconds``, and
    the CPU seconds per row the process spent meanwhile (every thread: the engine's own pool,
    spinning or not, included; nothing else of a job runs yet while streams are chosen)."""
    feeds = {k: _tile(v, batch) for k, v in sample.items()}
    engine.infer(feeds)  # warm: first-call allocations are not throughput
    calls = [0] * streams
    errors: list[BaseException] = []
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        try:
            while time.perf_counter() < stop:
                engine.infer(feeds)
                calls[i] += 1
        except BaseException as exc:  # reported by the caller, not lost in a thread
            errors.append(exc)

    start, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if errors:
        raise errors[0]
    rows = max(sum(calls) * batch, 1)
    return sum(calls) * batch / elapsed, cpu / rows


def relative_rates(
    measured: Mapping[int, list[float]], error: Mapping[int, str]
) -> dict[int, float]:
    """Each configuration's rate relative to configuration 0's, the median over the rounds
    both ran in (configuration 0 itself: 1.0); one that failed or never ran is left out (all,
    when configuration 0 did not run: then the remaining one's best decides, relative to 0).

    Paired rounds, not each configuration's best: a round's measurements ran a fraction of a
    second apart, so load from elsewhere hits both alike and their ratio keeps the difference
    between them; one configuration's best alone can come from a single quiet moment, and with
    a 0.1 s measurement that flipped the choice between runs on a busy 2-core host
    (benchmarks/dataset.py: auto chose one stream in one run, two in the next)."""
    ok = {i: m for i, m in measured.items() if m and i not in error}
    if 0 not in ok:
        return {i: max(m) for i, m in ok.items()}
    base = ok[0]
    return {
        i: 1.0 if i == 0 else float(np.median([r / b for r, b in zip(m, base) if b > 0] or [0.0]))
        for i, m in ok.items()
    }


def _tile(a: np.ndarray, rows: int) -> np.ndarray:
    reps = -(-rows // max(len(a), 1))
    return np.ascontiguousarray(np.concatenate([a] * reps)[:rows] if reps > 1 else a[:rows])


def choose_streams(
    engine: Engine,
    sample: Mapping[str, np.ndarray],
    batch: int,
    reload: Callable[[int], Engine] | None,
    *,
    available: int | None = None,
    seconds: float = 0.1,
    rounds: int = 5,
) -> tuple[StreamChoice, Engine | None]:
    """Measure one call at a time on the engine as loaded against one call per core.

    ``reload(threads)`` loads the artifact again with that many threads per call (None: the
    engine's threading cannot change, and one stream is chosen without measuring). The
    configurations are measured in ``rounds`` interleaved rounds and compared by the median of
    their per-round rates relative to one stream's (:func:`relative_rates`). Returns the choice and the engine reloaded for it (None when
    the engine as given is the one to use; else the caller owns and closes it).
    """
    n = available or cores()
    if reload is None:
        # Its threading was chosen by whoever loaded it (or cannot be set at load): calls on
        # top of an engine that already spreads over every core would only oversubscribe them.
        why = (
            "one stream: the engine's threading is not set here (an Engine was given, or its "
            "backend or device takes no threads at load); streams=N runs N calls at once"
        )
        return StreamChoice(1, None, (), why), None
    if n < 2 or not sample:
        return StreamChoice(1, None, (), f"one stream: {n} core(s)"), None
    other = reload(1)
    configs = [(1, None, engine), (n, 1, other)]
    measured: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    per_cpu: dict[int, list[float]] = {i: [] for i in range(len(configs))}  # rows per CPU-s
    error: dict[int, str] = {}
    try:
        for _ in range(rounds):
            for i, (streams, _t, e) in enumerate(configs):
                if i in error:
                    continue
                if i:
                    # The engine as loaded may leave its idle threads spinning after its last
                    # call (ONNX Runtime's, ~50 ms on one core): measured meanwhile, the
                    # one-thread streams shared a core with them for half of their 0.1 s
                    # (benchmarks/dataset.py under load: 0.78x one stream's rows/s, so one
                    # stream was chosen, while the engine alone ran 1.7x faster in streams).
                    settle()
                try:
                    r, cpu = rate_and_cpu(e, sample, batch, streams, seconds)
                    measured[i].append(r)
                    per_cpu[i].append(1.0 / cpu if cpu > 0 else r)
                except Exception as exc:
                    error[i] = f"{type(exc).__name__}: {exc}"
    except BaseException:
        if other is not engine:
            other.close()
        raise
    trials = tuple(
        StreamTrial(
            s,
            t,
            max(measured[i], default=None),
            error.get(i),
            tuple(measured[i]),
            tuple(per_cpu[i]),
        )
        for i, (s, t, _e) in enumerate(configs)
    )
    score = relative_rates(measured, error)
    if not score:
        if other is not engine:
            other.close()
        return StreamChoice(1, None, trials, "no configuration ran; one stream"), None
    thrift = relative_rates(per_cpu, error)
    top, least = max(score.values()), max(thrift.values())
    # Within the tolerance on rows per second OR on rows per CPU-second: fewer streams must be
    # clearly faster and clearly cheaper to win. On a busy host a call whose idle threads spin
    # gets more of the shared cores than independent calls and measures faster alone, while in
    # the job that spinning takes the cores the reader needs (benchmarks/dataset.py under load
    # 9: auto chose one stream by rows/s alone); CPU per row is what load disturbs least.
    pick = max(
        (i for i in score if score[i] >= (1 - TOLERANCE) * top
         or thrift.get(i, 0.0) >= (1 - TOLERANCE) * least),
        key=lambda i: configs[i][0],
    )  # fmt: skip
    streams, threads, chosen = configs[pick]
    per = "the artifact's own threading" if threads is None else f"{threads} thread(s) each"
    relative = ", ".join(
        f"{configs[i][0]} stream(s) {score[i]:.2f}x rows/s, {thrift.get(i, 0.0):.2f}x rows/CPU-s"
        for i in sorted(score)
    )
    reason = (
        f"most streams within {TOLERANCE:.0%} of the best rows/s or rows per CPU-second (each "
        f"the median over {rounds} interleaved rounds relative to one stream's in the same "
        f"round: {relative}; {n} cores, batch {batch}): {streams} x {per}"
    )
    if chosen is not other and other is not engine:
        other.close()
    return StreamChoice(streams, threads, trials, reason), (
        chosen if chosen is not engine else None
    )
