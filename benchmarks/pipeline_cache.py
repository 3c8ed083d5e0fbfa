"""Cold vs warm build phase of ``enginekit build -c``: the cost of a CI run where nothing changed.

One run builds a matrix of every backend available here (CPU) x fp32/fp16 on a ResNet-style CNN
(benchmarks/backends.py's model) into an empty cache, then runs the same build file again, and
prints each phase's seconds and the warm/cold ratio of the build phase (keys, cache lookups,
builds, copies; no bench). With ONNX Runtime alone, two option variants stand in for a second
backend.

    python benchmarks/pipeline_cache.py
    python benchmarks/pipeline_cache.py --jobs 2 --json result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import resnet_style

import enginekit as ek
from enginekit import backends as registry
from enginekit.pipeline import run


def build_file(folder: Path) -> tuple[Path, list[str]]:
    onnx.save(resnet_style(image=32, classes=10), folder / "cnn.onnx")
    names = [a.name for a in ek.available_backends() if a.available and "cpu" in a.devices]
    names = sorted(names, key=lambda n: n != "tvm")[:2]
    tables = []
    for name in names:
        listed = getattr(registry.get(name), "PRECISIONS", ("fp32", "fp16"))
        precisions = [p for p in ("fp32", "fp16") if p in listed]
        tables.append(f'[[engine]]\nbackend = "{name}"\nprecision = {json.dumps(precisions)}\n')
    if len(names) < 2:
        tables.append(
            '[[engine]]\nbackend = "onnxruntime"\nvariant = "basic"\nprecision = ["fp32", "fp16"]\n'
            'options = { optimization_level = "basic" }\n'
        )
    text = (
        '[model]\nsource = "cnn.onnx"\n[shapes]\nx = "1x3x32x32,8x3x32x32,16x3x32x32"\n'
        + "\n".join(tables)
        + "\n[bench]\nenabled = false\n"
    )
    (folder / "enginekit.toml").write_text(text)
    return folder / "enginekit.toml", names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", help="write the numbers to this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config, names = build_file(folder)
        cold = run(config, out=folder / "dist", cache=folder / "cache", jobs=args.jobs)
        warm = run(config, out=folder / "dist", cache=folder / "cache", jobs=args.jobs)
    rows = [(e["id"], e["status"], e["seconds"]) for e in cold["entries"]]
    rows += [(e["id"], e["status"], e["seconds"]) for e in warm["entries"]]
    print(f"backends: {', '.join(names) or 'onnxruntime'} (+ variants); jobs {args.jobs}")
    for entry_id, status, seconds in rows:
        print(f"  {entry_id:<40} {status:<7} {seconds:8.3f} s")
    c, w = cold["timings"]["build_s"], warm["timings"]["build_s"]
    print(f"build phase: cold {c:.3f} s, warm {w:.3f} s, warm/cold {w / c:.3f}")
    print(
        f"whole run:   cold {cold['timings']['total_s']:.3f} s, warm {warm['timings']['total_s']:.3f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cold": cold["timings"], "warm": warm["timings"], "ratio": w / c}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
