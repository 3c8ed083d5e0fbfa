"""Batch inference over datasets: rows/s of four ways to run the demo CNN over files.

(a) naive: read a batch, infer, write, one after the other, in one thread;
(b) ``enginekit infer`` (``ek.infer_dataset``): reading, the engine and writing overlapped;
(c) the engine alone on batches already in memory: the ceiling;
(d) Ray Data on a local 2-CPU cluster (``infer_dataset(ray=True)``: ``ek.ray.map_engine`` and
    the same ledgered shards), Parquet only.

Sources: a Parquet dataset (20k rows of 3x32x32 float32 as fixed-size lists) and a folder of 2k
generated PNG images (40x40, resized to 36, center-cropped to 32, mean/std). Goals: (b) >= 0.9x
(c) on Parquet; (d)'s overhead vs (b) <= 20%; a resume after kill -9 redoes at most one shard.
All rows/s are measured side by side in one run on this (possibly shared) machine: compare the
ratios, not the absolute numbers.

    python benchmarks/dataset.py            # the full run
    python benchmarks/dataset.py --quick    # a smoke test (2k rows, 200 images)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import enginekit as ek
from enginekit.dataset.columns import from_numpy, to_numpy

ROOT = Path(__file__).resolve().parent.parent


def demo_cnn(work: Path) -> Path:
    """The demo's CNN (examples/demo.py), exported and built for batches 1..256."""
    import torch
    from torch import nn

    class SmallCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            )  # fmt: skip
            self.classifier = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.features(x))

    torch.manual_seed(0)
    model = SmallCNN().eval()
    onnx = ek.export(model, (torch.randn(1, 3, 32, 32),), work / "cnn.onnx", dynamic_batch=True)
    shapes = {"x": [(1, 3, 32, 32), (64, 3, 32, 32), (256, 3, 32, 32)]}
    ek.build(onnx, backend="onnxruntime", shapes=shapes, output=work / "cnn.ekit").close()
    return work / "cnn.ekit"


def make_parquet(folder: Path, rows: int) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.random.default_rng(0).standard_normal((rows, 3, 32, 32)).astype(np.float32)
    folder.mkdir(parents=True)
    files = 4
    for i in range(files):
        lo, hi = i * rows // files, (i + 1) * rows // files
        table = pa.table({"id": np.arange(lo, hi), "x": from_numpy(x[lo:hi], "list")})
        pq.write_table(table, folder / f"part{i}.parquet", row_group_size=1024)
    return x


def make_images(folder: Path, count: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(
            folder / f"{i:05d}.png"
        )


PREP = ek.ImagePreprocess(resize=36, crop=32, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def naive_parquet(engine: ek.Engine, src: Path, out: Path, batch: int) -> int:
    """Read a batch, infer, write it; next batch. No overlap."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir()
    rows = 0
    with pq.ParquetWriter(
        out / "out.parquet", pa.schema([("id", pa.int64()), ("output", pa.list_(pa.float32(), 10))])
    ) as w:
        for f in sorted(src.glob("*.parquet")):
            for rb in pq.ParquetFile(f).iter_batches(batch_size=batch):
                x = to_numpy(rb.column("x"), "x")
                y = engine.infer({"x": x})["output"]
                w.write_table(pa.table({"id": rb.column("id"), "output": from_numpy(y, "list")}))
                rows += len(x)
    return rows


def naive_images(engine: ek.Engine, src: Path, out: Path, batch: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir()
    files = sorted(src.glob("*.png"))
    schema = pa.schema([("path", pa.string()), ("output", pa.list_(pa.float32(), 10))])
    with pq.ParquetWriter(out / "out.parquet", schema) as w:
        for i in range(0, len(files), batch):
            part = files[i : i + batch]
            x = np.stack([PREP(p) for p in part])
            y = engine.infer({"x": x})["output"]
            w.write_table(
                pa.table({"path": [p.name for p in part], "output": from_numpy(y, "list")})
            )
    return len(files)


def ceiling(engine: ek.Engine, x: np.ndarray, batch: int) -> float:
    """Rows/s of the engine alone over batches already in memory."""
    engine.infer(x[:batch])
    start = time.perf_counter()
    for i in range(0, len(x), batch):
        engine.infer(x[i : i + batch])
    return len(x) / (time.perf_counter() - start)


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


CHILD = """
import sys, enginekit as ek
ek.infer_dataset(sys.argv[1], sys.argv[2], sys.argv[3], batch_size=int(sys.argv[4]), shard_rows=int(sys.argv[5]), resume=True, progress=False)
"""


def resume_after_kill(artifact: Path, src: Path, out: Path, batch: int, shard_rows: int) -> dict:
    """kill -9 a run after a few shards, rerun it: how many shards were redone."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(artifact), str(src), str(out), str(batch), str(shard_rows)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ledger = out / "_enginekit_ledger.json"
    committed = 0
    while proc.poll() is None:
        try:
            committed = len(json.loads(ledger.read_text())["shards"])
        except (FileNotFoundError, ValueError):
            committed = 0
        if committed >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    committed = len(json.loads(ledger.read_text())["shards"])
    on_disk = len(list(out.glob("part-*")))
    s = ek.infer_dataset(artifact, src, out, resume=True, progress=False)
    # Work lost to the kill: shards whose file was written but not committed (written again).
    return {
        "killed": proc.returncode == -signal.SIGKILL,
        "committed_at_kill": committed,
        "files_at_kill": on_disk,
        "redone": on_disk - committed,
        "shards": s.shards,
        "written_on_rerun": s.shards_written,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small data")
    parser.add_argument("--no-ray", action="store_true", help="skip (d)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    rows, images = (2000, 200) if args.quick else (20000, 2000)
    reps = 2 if args.quick else 3
    host = ek.target.host() if hasattr(ek, "target") else None
    from enginekit.target import host as host_facts

    host = host_facts()
    print(f"host: {host['cpu']} ({host['machine']}), {os.cpu_count()} CPUs")
    print(
        f"ISA: {' '.join(f for f in host['isa'] if f.startswith(('avx', 'sse4', 'fma', 'amx', 'neon')))}"
    )
    work = Path(tempfile.mkdtemp(prefix="ek-dataset-bench-"))
    results: dict = {"rows": rows, "images": images, "host": host}
    try:
        artifact = demo_cnn(work)
        x = make_parquet(work / "parquet", rows)
        make_images(work / "images", images)
        engine = ek.load(artifact)
        # The automatic batch size, as enginekit infer would choose it (recorded, then reused).
        t_auto, auto = timed(
            ek.infer_dataset, engine, work / "parquet", work / "auto", progress=False
        )

        batch = auto.batch_size
        print(
            f"batch size auto -> {batch} ({auto.batch_choice.reason}; whole job incl. search {t_auto:.1f} s)"
        )
        table = []
        # Parquet: (a), (b), (c) back to back in each round, so that noise from elsewhere on
        # the machine hits them alike; the median over rounds, and the median of the rounds'
        # own ratios.
        pa_r, pb_r, pc_r = [], [], []
        for rep in range(reps):
            t, n = timed(naive_parquet, engine, work / "parquet", work / f"naive{rep}", batch)
            pa_r.append(n / t)
            t, _ = timed(
                ek.infer_dataset, engine, work / "parquet", work / f"ek{rep}", batch, progress=False
            )
            pb_r.append(rows / t)
            pc_r.append(ceiling(engine, x, batch))
        a, b, c = (float(np.median(r)) for r in (pa_r, pb_r, pc_r))
        ratio_bc = float(np.median([q / w for q, w in zip(pb_r, pc_r)]))
        print(f"parquet rounds: (b)/(c) = {', '.join(f'{q / w:.2f}' for q, w in zip(pb_r, pc_r))}")
        d = None
        if not args.no_ray:
            import ray

            ray.init(
                num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False
            )
            ray.data.DataContext.get_current().enable_progress_bars = False
            try:
                t, _ = timed(
                    ek.infer_dataset,
                    artifact,
                    work / "parquet",
                    work / "ray0",
                    batch,
                    ray=True,
                    progress=False,
                )

                t2, _ = timed(
                    ek.infer_dataset,
                    artifact,
                    work / "parquet",
                    work / "ray1",
                    batch,
                    ray=True,
                    progress=False,
                )

                d = rows / min(t, t2)
            finally:
                ray.shutdown()
        table.append(("parquet", a, b, c, d))
        # Images: decoding dominates; (b) decodes in a thread pool ahead of the engine.
        ia_r, ib_r = [], []
        for rep in range(reps):
            t, n = timed(naive_images, engine, work / "images", work / f"inaive{rep}", batch)
            ia_r.append(n / t)
            t, _ = timed(
                ek.infer_dataset, engine, work / "images", work / f"iek{rep}", batch,
                preprocess=PREP, progress=False,
            )  # fmt: skip
            ib_r.append(images / t)
        ia, ib = float(np.median(ia_r)), float(np.median(ib_r))
        xi = np.stack([PREP(p) for p in sorted((work / "images").glob("*.png"))])
        ic = ceiling(engine, np.concatenate([xi] * max(1, 2000 // len(xi))), batch)
        table.append(("images", ia, ib, ic, None))
        resume = resume_after_kill(
            artifact, work / "parquet", work / "resume", batch, max(batch, rows // 40)
        )
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    print()
    print(f"rows/s (batch {batch}, ONNX Runtime CPU)")
    print(
        f"{'source':8}  {'(a) naive':>10}  {'(b) enginekit':>13}  {'(c) engine alone':>16}  {'(d) Ray':>8}  {'b/c':>5}  {'b/a':>5}  {'d/b':>5}"
    )
    for name, a_, b_, c_, d_ in table:
        print(
            f"{name:8}  {f(a_):>10}  {f(b_):>13}  {f(c_):>16}  {f(d_):>8}  {b_ / c_:5.2f}  {b_ / a_:5.2f}  "
            f"{(f'{d_ / b_:5.2f}' if d_ else '    -')}"
        )
    _, pb, _, pd = table[0][1:]
    print()
    print(
        f"goal (b) >= 0.9x (c) on Parquet: median of the rounds' ratios {ratio_bc:.2f}x -> "
        f"{'met' if ratio_bc >= 0.9 else 'NOT met'}"
    )
    if pd:
        overhead = 1 - pd / pb
        print(
            f"goal (d) overhead vs (b) <= 20%: {overhead:.0%} -> {'met' if overhead <= 0.2 else 'NOT met'}"
        )
    print(
        f"resume after kill -9: {resume['committed_at_kill']} shards committed, "
        f"{resume['files_at_kill']} on disk at the kill; rerun wrote {resume['written_on_rerun']} of "
        f"{resume['shards']}; redone {resume['redone']} (goal <= 1) -> "
        f"{'met' if resume['redone'] <= 1 and resume['killed'] else 'NOT met'}"
    )
    results.update(batch=batch, table=table, resume=resume)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
