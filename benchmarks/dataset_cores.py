"""Where ``enginekit infer``'s core-seconds go: (b) against the engine alone (c), accounted.

On a machine with ``N`` cores a job of ``wall`` seconds has ``N x wall`` core-seconds. This
script runs (c) (the engine alone on in-memory batches, ``streams`` threads) and (b)
(``ek.infer_dataset`` on the benchmark's Parquet rows, same engine object, same batch size)
alternating, and splits each run's core-seconds into:

- ``engine``: CPU of the threads inside ``Engine.infer`` (each call's thread CPU time);
- ``streams``: the rest of the engine threads' CPU (taking batches, gathering outputs);
- ``reader``, ``writer``: the reader's and writer's threads (the job's stage timers);
- ``main``: the rest of this process (the calling thread, pyarrow's I/O threads);
- ``not ours``: the cores' time this process did not use — idle, the hypervisor's steal, or
  other processes — with ``/proc/stat``'s idle and steal over the run beside it (on a shared
  host the cores this process leaves go to other processes, so ``not ours`` is the time its
  threads were not runnable, not only idle time);

and, for the engine's threads, their voluntary and involuntary context switches
(``getrusage(RUSAGE_THREAD)``: sleeping on the GIL, a lock or a queue; preempted), the time
from the job's start to the first engine call (``head``) and from the last call's end to the
job's return (``tail``: the last shard's write and the ledger's commit).

    PYTHONPATH=$PWD python benchmarks/dataset_cores.py [--rounds 5] [--batch 64] [--json FILE]

``--autogroup-nice N`` (Linux) sets this process's autogroup niceness first: on a host shared
with other sessions' jobs it makes the run close to a quiet machine's (the other sessions'
processes get the cores only when this one leaves them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import enginekit as ek

sys.path.insert(0, str(Path(__file__).parent))
import dataset as bench  # benchmarks/dataset.py: the model, the dataset and the ceiling


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _stat() -> dict[str, float]:
    """Seconds of all cores, from /proc/stat: idle (with iowait), steal, busy."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return {"idle": 0.0, "steal": 0.0}
    hz = os.sysconf("SC_CLK_TCK")
    return {"idle": (v[3] + v[4]) / hz, "steal": (v[7] if len(v) > 7 else 0) / hz}


class Calls:
    """Wraps an engine's ``infer``: per thread, each call's start and end and CPU time
    (``time.thread_time``: exact, where ``getrusage`` lags by the running slice), and the
    thread's context switches (``RUSAGE_THREAD``: system calls that keep the GIL, unlike
    reading ``/proc``, which would add sleeps of their own)."""

    def __init__(self, engine: ek.Engine) -> None:
        self.engine, self.infer = engine, engine.infer
        self.threads: dict[int, dict[str, Any]] = {}
        engine.infer = self._infer  # type: ignore[method-assign]

    def _infer(self, batch: Any) -> Any:
        me = self.threads.get(threading.get_ident())
        if me is None:
            me = self.threads[threading.get_ident()] = {
                "start": resource.getrusage(resource.RUSAGE_THREAD), "cpu": 0.0, "calls": 0,
            }  # fmt: skip
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self.infer(batch)
        t1, c1 = time.perf_counter(), time.thread_time()
        me.setdefault("first", t0)
        me["cpu"] += c1 - c0
        me["calls"] += 1
        me["last"], me["end"] = t1, resource.getrusage(resource.RUSAGE_THREAD)
        return out

    def reset(self) -> None:
        self.threads = {}

    def close(self) -> None:
        self.engine.infer = self.infer  # type: ignore[method-assign]

    def summary(self, began: float, ended: float, exclude: int | None = None) -> dict[str, float]:
        """The calls of the threads that ran since :meth:`reset`, but thread ``exclude`` (the
        thread that calls (c) warms the engine up and, with streams, runs no stream)."""
        ts = [t for i, t in self.threads.items() if i != exclude]
        return {
            "engine": sum(t["cpu"] for t in ts),
            "calls": sum(t["calls"] for t in ts),
            "voluntary": sum(t["end"].ru_nvcsw - t["start"].ru_nvcsw for t in ts),
            "involuntary": sum(t["end"].ru_nivcsw - t["start"].ru_nivcsw for t in ts),
            "head": min(t["first"] for t in ts) - began,
            "tail": ended - max(t["last"] for t in ts),
        }


def account(wall: float, cpu: float, cores: int, stat: dict[str, float], **parts: float) -> dict:
    """One run's core-seconds: the parts given, ``main`` (the rest of ``cpu``), ``not ours``."""
    out = {"wall": wall, "cores_s": cores * wall, "cpu": cpu, **parts}
    out["main"] = max(cpu - sum(parts.values()), 0.0)
    out["not_ours"] = max(cores * wall - cpu, 0.0)
    out["idle"], out["steal"] = stat["idle"], stat["steal"]
    return out


def rounds(
    artifact: Path, src: Path, x: np.ndarray, work: Path, batch: int, streams: int, n: int,
    rows: int,
) -> dict[str, list[dict]]:  # fmt: skip
    """(c) then (b), ``n`` rounds; each run's accounting."""
    from enginekit.dataset.streams import cores

    k = cores()
    engine = ek.load(artifact, threads=1) if streams > 1 else ek.load(artifact)
    calls = Calls(engine)
    out: dict[str, list[dict]] = {"b": [], "c": []}
    try:
        for rep in range(n):
            calls.reset()
            s0, c0, t0 = _stat(), _cpu(), time.perf_counter()
            rate = bench.ceiling(engine, x, batch, streams, rows)
            t1, c1, s1 = time.perf_counter(), _cpu(), _stat()
            c = calls.summary(t0, t1, threading.get_ident() if streams > 1 else None)
            stat = {key: s1[key] - s0[key] for key in s0}
            out["c"].append(
                {**account(t1 - t0, c1 - c0, k, stat, engine=c["engine"]), **c, "rows_s": rate}
            )
            calls.reset()
            dst = work / f"b-{rep}"
            s0, c0, t0 = _stat(), _cpu(), time.perf_counter()
            s = ek.infer_dataset(engine, src, dst, batch, progress=False, streams=streams)
            t1, c1, s1 = time.perf_counter(), _cpu(), _stat()
            shutil.rmtree(dst, ignore_errors=True)
            st = s.stages
            b = calls.summary(t1 - s.seconds, t1)
            stat = {key: s1[key] - s0[key] for key in s0}
            parts = {
                "engine": b["engine"],
                "streams": max(st.infer_cpu - b["engine"], 0.0),
                "reader": st.read_cpu,
                "writer": st.write_cpu,
            }
            # The job's own seconds (s.seconds: from preparing its output to its summary), and
            # the CPU of the whole call (opening the source too: a few ms).
            row = account(s.seconds, c1 - c0, k, stat, **parts)
            out["b"].append({**row, **b, "rows_s": rows / s.seconds, "load": os.getloadavg()[0]})
            print(
                f"round {rep}: (b)/(c) {rows / s.seconds / rate:.2f}, (b) {rows / s.seconds:,.0f} "
                f"rows/s, (c) {rate:,.0f}; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        calls.close()
        engine.close()
    return out


KEYS = (
    "wall", "cores_s", "engine", "streams", "reader", "writer", "main", "not_ours", "idle",
    "steal", "head", "tail", "voluntary", "involuntary", "calls",
)  # fmt: skip


def medians(runs: list[dict]) -> dict[str, float]:
    return {k: float(statistics.median(r.get(k, 0.0) for r in runs)) for k in KEYS}


def table(result: dict[str, list[dict]], skip_first: bool = True) -> str:
    """Medians of each run's parts (the first round, warming up, left out when there are more)."""
    lines = ["part                 (b)        (c)   (core-seconds per job, medians; (b) - (c))"]
    b_runs, c_runs = result["b"], result["c"]
    if skip_first and len(b_runs) > 1:
        b_runs, c_runs = b_runs[1:], c_runs[1:]
    b, c = medians(b_runs), medians(c_runs)
    for k in KEYS:
        unit = "" if k in ("voluntary", "involuntary", "calls") else " s"
        lines.append(f"{k:14s} {b[k]:10.3f} {c[k]:10.3f}   {b[k] - c[k]:+.3f}{unit}")
    ratios = [rb["rows_s"] / rc["rows_s"] for rb, rc in zip(b_runs, c_runs)]
    lines.append(
        f"(b)/(c) per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.2f}"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=40_000, help="rows of each (b) and (c) run")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--autogroup-nice", type=int, help="set this process's autogroup niceness")
    p.add_argument("--json")
    args = p.parse_args()
    if args.autogroup_nice is not None:
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(args.autogroup_nice))
        except OSError as exc:
            print(f"autogroup niceness not set: {exc}")
    work = Path(tempfile.mkdtemp(prefix="ek-cores-"))
    try:
        artifact = bench.demo_cnn(work)
        x = bench.make_parquet(work / "x", min(args.rows, 20_000))
        assert x is not None
        bench.make_parquet(work / "src", args.rows, files=max(1, min(4, args.rows // 10_000)))
        print(f"load {os.getloadavg()[0]:.1f}; batch {args.batch}, {args.streams} stream(s)")
        result = rounds(
            artifact, work / "src", x, work, args.batch, args.streams, args.rounds, args.rows
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
