"""Parquet pages decompressed into the batch (cramjam) against the copy path, A/B in one process.

Two measurements on the benchmark's dataset (benchmarks/dataset.py: the demo CNN's 3x32x32
float32 rows, snappy, row groups of 1024): the reader alone (CPU-s per 20k rows, the two paths
alternating, ``--pairs`` pairs) and the job (``enginekit infer``'s (b) next to the engine
alone (c), 2 streams of one thread, ``--rounds`` rounds each path, alternating): (b)/(c), the
reader + writer CPU over the engine threads' CPU, the reader's CPU per 1k rows. Each line
prints ``/proc/loadavg``'s first field; the copy path is the page reader with
``pages.INTO`` emptied (what runs without cramjam).

    PYTHONPATH=$PWD python benchmarks/dataset_pages.py [--quick] [--no-job] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import enginekit as ek
from enginekit.dataset import pages
from enginekit.dataset.parquet import ParquetSource

sys.path.insert(0, str(Path(__file__).parent))
import dataset as bench  # benchmarks/dataset.py: the dataset and the ceiling

SPEC = [ek.TensorSpec("x", "float32", ("batch", 3, 32, 32))]
_INTO = dict(pages.INTO)


@contextmanager
def path(mode: str) -> Iterator[None]:
    """``"into"``: pages decompressed into the batch; ``"copy"``: into a buffer, then copied."""
    pages.INTO.clear()
    if mode == "into":
        pages.INTO.update(_INTO)
    try:
        yield
    finally:
        pages.INTO.clear()
        pages.INTO.update(_INTO)


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def read_once(src: Path, batch: int) -> float:
    """CPU-s per 20k rows to read ``src`` on this thread (the reader stage alone)."""
    t = time.thread_time()
    rows = sum(p.rows for p in ParquetSource(src, SPEC, None, None, False).pieces(0, batch))
    return (time.thread_time() - t) * 20000 / rows


def reader_ab(src: Path, pairs: int, batch: int = 256) -> dict:
    """The reader alone, copy and into alternating (the order flips each pair)."""
    out: dict = {"copy": [], "into": []}
    for mode in ("copy", "into"):  # warm the page cache and the imports
        with path(mode):
            read_once(src, batch)
    for i in range(pairs):
        for mode in ("copy", "into") if i % 2 == 0 else ("into", "copy"):
            with path(mode):
                out[mode].append(read_once(src, batch))
        print(f"reader alone: copy {out['copy'][-1]:.4f} into {out['into'][-1]:.4f} CPU-s per 20k rows; load {load()}", flush=True)  # fmt: skip
    ratios = [b / a for a, b in zip(out["copy"], out["into"])]
    return {**out, "ratios": ratios, "ratio": statistics.median(ratios)}


def job_ab(src: Path, work: Path, rounds: int, rows: int, batch: int = 256) -> dict:
    """The job's (b) next to (c), each path ``rounds`` times, alternating."""
    import pyarrow.parquet as pq

    first = sorted(src.glob("*.parquet"))[0]
    x = np.asarray(pq.read_table(first, columns=["x"]).column("x").to_pylist(), np.float32)
    engine = ek.load(bench.demo_cnn(work), threads=1)
    out: dict = {m: {"ratio": [], "share": [], "read": []} for m in ("copy", "into")}
    for i in range(rounds):
        for mode in ("copy", "into") if i % 2 == 0 else ("into", "copy"):
            with path(mode):
                c = bench.ceiling(engine, x[:2560], batch, 2, rows)
                s = ek.infer_dataset(engine, src, work / "out", batch, progress=False, streams=2)
            shutil.rmtree(work / "out", ignore_errors=True)
            st, b = s.stages, rows / s.seconds
            share = (st.read_cpu + st.write_cpu) / st.infer_cpu
            r = out[mode]
            r["ratio"].append(b / c)
            r["share"].append(share)
            r["read"].append(st.read_cpu / rows * 1000)
            print(f"job {mode}: (b) {b:,.0f} (c) {c:,.0f} rows/s, (b)/(c) {b / c:.3f}, reader + writer / engine CPU {share:.1%}, reader {r['read'][-1]:.4f} CPU-s per 1k rows; load {load()}", flush=True)  # fmt: skip
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small data")
    parser.add_argument("--no-job", action="store_true", help="the reader alone only")
    parser.add_argument("--pairs", type=int, help="reader-alone pairs (default 6)")
    parser.add_argument("--rounds", type=int, help="job rounds per path (default 4)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    rows = 4000 if args.quick else 40000
    work = Path(tempfile.mkdtemp(prefix="ek-pages-bench-"))
    try:
        bench.make_parquet(work / "parquet", rows)
        results: dict = {"rows": rows, "load_start": load()}
        r = reader_ab(work / "parquet", args.pairs or (2 if args.quick else 6))
        results["reader"] = r
        print(f"reader alone, into / copy per pair: median {r['ratio']:.3f} ({min(r['ratios']):.3f}-{max(r['ratios']):.3f}); copy median {statistics.median(r['copy']):.4f}, into {statistics.median(r['into']):.4f} CPU-s per 20k rows")  # fmt: skip
        if not args.no_job:
            j = job_ab(work / "parquet", work, args.rounds or (1 if args.quick else 4), rows)
            results["job"] = j
            for mode, d in j.items():
                print(f"job {mode}: " + ", ".join(f"{k} median {statistics.median(v):.4f} ({min(v):.4f}-{max(v):.4f})" for k, v in d.items()))  # fmt: skip
        results["load_end"] = load()
        print(f"load at the start {results['load_start']}, at the end {results['load_end']}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
