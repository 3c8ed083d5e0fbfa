"""XLA backend vs ONNX Runtime: a CNN and a transformer of the corpus at fp32/bf16, and layouts.

Prints, in one run, side by side (the host's CPU, ISA flags and load first):
  0. ``--part real`` (default): a CNN and a transformer from corpus/ (``--cnn tv-resnet50``,
     ``--transformer timm-deit_tiny``) at batch 1 and 16: ONNX Runtime's default session and
     XLA at each precision (``--precisions fp32,bf16``; built with verification on, so a
     precision that misses its tolerance shows as failed), median latency, speed vs ONNX
     Runtime, the XLA option set the build picked, error vs fp32 XLA (max abs error relative to
     the output's largest magnitude); then the goals table (XLA fp32 >= 1.0x ONNX Runtime per
     family and batch; reduced precisions pass verification), met or not met. ``--json``
     prints the same as one JSON report;
  1. ``--part values``: ONNX's backend test cases that feed shape-like values as inputs (Reshape's
     shape, Range limits, Resize sizes, ...) through build + load on XLA, against the cases raw
     ONNX Runtime passes;
  2. ``--part layouts``: median latency at batch 1 and 32 of ONNX Runtime (default session) and
     of the XLA engine for each layout (nhwc, nchw) and XLA option set (xla-default, ynn-off);
  3. what `layout=auto, xla_flags=auto` picks at build time;
  4. compile seconds per batch bucket (1, 2, 4, ..., 32) of one engine fed batches 1..32.

    python benchmarks/xla.py [--part real|values|layouts|all] [--precisions fp32,bf16] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's enginekit, not an installed one
    sys.path.insert(0, str(ROOT))

import enginekit as ek  # noqa: E402

BATCHES = (1, 32)


def resnet(width: int = 32):
    """A small ResNet: stem, three stages of two basic blocks, global pool, FC (BN folds on export)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))

    torch.manual_seed(0)
    layers = [nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers).eval()


def interleaved_ms(
    engines: dict[str, ek.Engine], x: np.ndarray, seconds: float, rounds: int = 7
) -> dict[str, float]:
    """Median per-call milliseconds, measured round-robin so load spikes hit every engine alike."""
    per_call = {}
    for label, engine in engines.items():
        engine.infer(x)
        start = time.perf_counter()
        engine.infer(x)
        per_call[label] = time.perf_counter() - start
    budget = seconds / rounds
    reps = {label: max(1, int(budget / max(t, 1e-6))) for label, t in per_call.items()}
    samples: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, engine in engines.items():
            start = time.perf_counter()
            for _ in range(reps[label]):
                engine.infer(x)
            samples[label].append((time.perf_counter() - start) / reps[label])
    return {label: statistics.median(v) * 1e3 for label, v in samples.items()}


REAL_BATCHES = (1, 16)
PRECISIONS = ("fp32", "bf16")
#: The corpus entries timed by default: a CNN and a transformer (corpus/).
MODELS = {"cnn": "tv-resnet50", "transformer": "timm-deit_tiny"}
#: Speed goal (issue 15, item 4): XLA at fp32 vs ONNX Runtime's default session.
GOAL = 1.0


def corpus_model(name: str) -> tuple[Path, dict, dict[int, dict]]:
    """A corpus entry, prepared (exported once, cached): path, build shapes, feeds per batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import corpus

    prepared = corpus.prepare(corpus.select([name])[0])
    base = prepared.samples[0].feeds
    top = max(REAL_BATCHES)
    shapes = {n: [(1, *a.shape[1:]), (top, *a.shape[1:]), (top, *a.shape[1:])]
              for n, a in base.items()}  # fmt: skip
    feeds = {b: {n: np.repeat(a[:1], b, axis=0) for n, a in base.items()} for b in REAL_BATCHES}
    return prepared.onnx, shapes, feeds


class _OrtDefault:
    """ONNX Runtime's default session (what the speed goal compares with), as an engine."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def infer(self, feeds: dict) -> dict:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feeds)))

    def close(self) -> None:
        pass


def run_real(models: dict[str, str], precisions: tuple[str, ...], seconds: float) -> list[dict]:
    """Part 0: corpus models, ONNX Runtime's default session vs XLA at each precision."""
    rows = []
    for family, name in models.items():
        path, shapes, feeds = corpus_model(name)
        engines: dict[str, Any] = {"onnxruntime": _OrtDefault(path)}
        failed: dict[str, str] = {}
        for precision in precisions:
            try:  # verification on: a precision that misses its tolerance is not timed
                engines[f"xla {precision}"] = ek.build(
                    str(path), backend="xla", shapes=shapes, precision=precision
                )
            except ek.EnginekitError as exc:
                failed[f"xla {precision}"] = str(exc).splitlines()[0][:200]
        by_batch = {
            b: interleaved_ms(engines, feeds[b], seconds * len(engines)) for b in REAL_BATCHES
        }
        fp32 = engines.get("xla fp32")
        reference = fp32.infer(feeds[REAL_BATCHES[-1]]) if fp32 else None
        for label, engine in engines.items():
            row: dict[str, Any] = {"family": family, "model": name, "engine": label}
            for b in REAL_BATCHES:
                row[f"b{b}_ms"] = round(by_batch[b][label], 3)
                row[f"b{b}_vs_ort"] = round(by_batch[b]["onnxruntime"] / by_batch[b][label], 3)
            if label.startswith("xla"):
                meta = engine.manifest["backend"]["metadata"]
                row["xla_flags"] = meta["xla_flags"]
                row["verified"] = bool((engine.manifest.get("verify") or {}).get("passed"))
            if reference is not None and label.startswith("xla") and label != "xla fp32":
                got = engine.infer(feeds[REAL_BATCHES[-1]])
                row["error_vs_fp32"] = max(
                    float(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30))
                    for k, v in reference.items()
                )
            rows.append(row)
        rows += [
            {"family": family, "model": name, "engine": label, "error": why}
            for label, why in failed.items()
        ]
        for engine in engines.values():
            engine.close()
    return rows


def goals(rows: list[dict], precisions: tuple[str, ...]) -> list[dict]:
    """Met / not met: XLA fp32 >= GOAL x ONNX Runtime at each batch and family; every reduced
    precision builds (verification passes)."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = {r["engine"]: r for r in rows if r["family"] == family}
        fp32 = mine.get("xla fp32", {})
        for b in REAL_BATCHES:
            ratio = fp32.get(f"b{b}_vs_ort")
            out.append({
                "goal": f"{family} ({fp32.get('model', '?')}) b{b}: xla fp32 >= {GOAL}x ORT",
                "value": ratio,
                "met": ratio is not None and ratio >= GOAL,
            })  # fmt: skip
        for precision in precisions[1:]:
            row = mine.get(f"xla {precision}", {})
            out.append({
                "goal": f"{family} xla {precision} passes verification",
                "value": row.get("error") or row.get("error_vs_fp32"),
                "met": bool(row.get("verified")),
            })  # fmt: skip
    return out


def print_real(rows: list[dict], met: list[dict]) -> None:
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        print(f"\n{family}: {mine[0]['model']}")
        print(f"{'engine':<14}" + "".join(f"{f'b{b} ms':>11}{'vs ORT':>9}" for b in REAL_BATCHES)
              + f"{'flags':>13}{'err vs fp32':>13}")  # fmt: skip
        for r in mine:
            if "error" in r:
                print(f"{r['engine']:<14} failed: {r['error']}")
                continue
            cells = "".join(
                f"{r[f'b{b}_ms']:>11.2f}{r[f'b{b}_vs_ort']:>8.2f}x" for b in REAL_BATCHES
            )
            error = f"{r['error_vs_fp32']:>13.2e}" if "error_vs_fp32" in r else ""
            print(f"{r['engine']:<14}{cells}{r.get('xla_flags', ''):>13}{error}")
    print("\ngoals")
    for g in met:
        value = g["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value or "")
        print(f"  {'met    ' if g['met'] else 'NOT MET'}  {g['goal']:<52} {shown[:60]}")


def run_values(dirs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Part ``values``: ONNX's backend test cases that have value inputs (inputs whose values
    decide shapes, enginekit/backends/xla/values.py) through ``ek.build`` + ``ek.load`` on XLA,
    against the cases raw ONNX Runtime passes (benchmarks/onnx_testdata.py's runner)."""
    import importlib.util

    import onnx

    from enginekit.backends.xla import values

    spec = importlib.util.spec_from_file_location(
        "benchmarks_onnx_testdata", Path(__file__).with_name("onnx_testdata.py")
    )
    runner = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules.setdefault("benchmarks_onnx_testdata", runner)  # its dataclasses look it up
    spec.loader.exec_module(runner)  # type: ignore[union-attr]
    cases, _ = runner.cases(list(dirs or runner.DIRS))
    picked = [c for c in cases if values.find(onnx.load(str(c.model), load_external_data=False))]
    raw, failed = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in picked:
            if runner.run_raw(case) is not None:
                continue
            raw += 1
            error, _ = runner.run_enginekit(case, "xla", Path(tmp))
            if error is not None:
                failed[f"{case.dir}/{case.name}"] = error
    return {"cases": len(picked), "raw_onnxruntime": raw, "xla": raw - len(failed),
            "failed": failed}  # fmt: skip


def host() -> dict[str, Any]:
    """The CPU and the ISA flags that decide reduced-precision speed."""
    import os

    from enginekit import target

    flags = target.cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx512_fp16")
           if f in flags]  # fmt: skip
    return {"cpu": target.cpu_name(), "isa": isa, "load": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("real", "values", "layouts", "all"), default="real")
    parser.add_argument("--cnn", default=MODELS["cnn"], help="corpus entry timed as the CNN")
    parser.add_argument("--transformer", default=MODELS["transformer"], help="corpus entry")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="e.g. fp32,bf16,fp16")
    parser.add_argument("--size", type=int, default=64, help="layouts part: input height, width")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON report")
    args = parser.parse_args(argv)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if precisions[:1] != ("fp32",):
        parser.error("--precisions must start with fp32 (the others are compared with it)")
    info = host()
    if not args.json:
        print(f"host: {info['cpu']}, ISA: {' '.join(info['isa']) or 'none of avx2/avx512'}, "
              f"load {' '.join(f'{x:.1f}' for x in info['load'])}")  # fmt: skip
    report: dict[str, Any] = {"host": info, "batches": list(REAL_BATCHES)}
    if args.part in ("real", "all"):
        models = {"cnn": args.cnn, "transformer": args.transformer}
        rows = run_real(models, precisions, args.seconds)
        report["rows"], report["goals"] = rows, goals(rows, precisions)
        if not args.json:
            print_real(rows, report["goals"])
    if args.part in ("values", "all"):
        report["values"] = found = run_values()
        share = found["xla"] / max(found["raw_onnxruntime"], 1)
        report.setdefault("goals", []).append({
            "goal": "ONNX test cases with value inputs: xla >= 0.95x raw ONNX Runtime's passes",
            "value": round(share, 3),
            "met": share >= 0.95,
        })  # fmt: skip
        if not args.json:
            print(f"\nONNX test cases with value inputs: {found['cases']}; raw ONNX Runtime "
                  f"passes {found['raw_onnxruntime']}, xla {found['xla']}")  # fmt: skip
            for name, error in found["failed"].items():
                print(f"  {name}: {error[:150]}")
            print(f"  {'met    ' if share >= 0.95 else 'NOT MET'}  {share:.3f} of raw (goal 0.95)")
    if args.part in ("layouts", "all"):
        import torch

        work = Path(tempfile.mkdtemp(prefix="enginekit-bench-xla-"))
        run_layouts(work, args.size, args.seconds, torch)
    if args.json:
        print(json.dumps(report, indent=2))


def run_layouts(work: Path, size: int, seconds: float, torch: Any) -> None:
    """Parts 1-3: layouts and XLA option sets on the ResNet-style CNN, auto's pick, buckets."""

    shape = (3, size, size)
    path = ek.export(resnet(), (torch.randn(1, *shape),), work / "resnet.onnx", dynamic_batch=True)
    shapes = {"input": [(1, *shape), (32, *shape), (32, *shape)]}
    name = ek.load_model(path).inputs[0].name
    shapes = {name: shapes["input"]}
    rng = np.random.default_rng(0)
    feeds = {b: rng.standard_normal((b, *shape)).astype(np.float32) for b in BATCHES}

    print(f"ResNet-style CNN, input {size}x{size}, {torch.get_num_threads()} threads")
    engines: dict[str, ek.Engine] = {
        "onnxruntime (default)": ek.build(path, backend="onnxruntime", shapes=shapes, verify=False)
    }
    for layout in ("nhwc", "nchw"):
        for flags in ("xla-default", "ynn-off"):
            engines[f"xla {layout} {flags}"] = ek.build(
                path, backend="xla", shapes=shapes, verify=False, layout=layout, xla_flags=flags
            )
    by_batch = {b: interleaved_ms(engines, feeds[b], seconds * len(engines)) for b in BATCHES}
    rows = {label: {b: by_batch[b][label] for b in BATCHES} for label in engines}
    for engine in engines.values():
        engine.close()

    base = rows["onnxruntime (default)"]
    print(f"\n{'engine':<28}" + "".join(f"{f'batch {b} ms':>14}{'vs ORT':>9}" for b in BATCHES))
    for label, ms in rows.items():
        cells = "".join(f"{ms[b]:>14.3f}{base[b] / ms[b]:>8.2f}x" for b in BATCHES)
        print(f"{label:<28}{cells}")
    for b in BATCHES:
        nhwc = min(rows[f"xla nhwc {f}"][b] for f in ("xla-default", "ynn-off"))
        nchw = min(rows[f"xla nchw {f}"][b] for f in ("xla-default", "ynn-off"))
        print(f"batch {b}: best NHWC is {nchw / nhwc:.2f}x the speed of best NCHW")

    start = time.perf_counter()
    auto = ek.build(path, backend="xla", shapes=shapes, output=work / "auto.ekit", layout="auto")
    meta = auto.manifest["backend"]["metadata"]
    print(
        f"\nlayout=auto, xla_flags=auto: built in {time.perf_counter() - start:.1f} s, picked "
        f"{meta['layout']} / {meta['xla_flags']} {meta['compiler_options']}"
    )
    for trial in meta["tuning"]:
        print(
            f"  {trial['layout']:<5} {trial['flags']:<12} {trial['ms']:>9.3f} ms "
            f"(compile {trial['compile_s']:.2f} s)"
        )
    auto.close()

    engine = ek.load(work / "auto.ekit")
    x = rng.standard_normal((32, *shape)).astype(np.float32)
    for b in range(1, 33):
        engine.infer(x[:b])
    print(f"\nbatches 1..32 compiled {len(engine.programs)} programs (log2(32)+1 = 6):")
    for key, seconds in engine.programs.items():
        print(f"  {key:<16} {seconds:.2f} s")
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
