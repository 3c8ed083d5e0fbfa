"""INT8 vs FP32 on the ONNX Runtime backend, side by side in one run, batch 1 and 32.

The model is ResNet-18-shaped (17 convs + 3 downsampling convs, 112x112 inputs) with random
convolutions, BatchNorm statistics set on the data, and a classifier head fitted to a
synthetic 10-class task (class prototypes + noise), so its top-1 is meaningful: the fp32 model
classifies the held-out set almost perfectly, and INT8 must agree with it.

    python benchmarks/int8.py [--rounds 8] [--threads 0] [--variants] [--fp16] [--keep DIR]

Prints images/s per engine and batch, the INT8/FP32 ratio, top-1 agreement and accuracy.
Goal: >= 2x throughput at batch 32 with top-1 agreement >= 99%.
--variants also builds the int8 layouts that were tried (per-tensor weights, no 7-bit weights,
the TensorRT-style int8 Q/DQ, minmax calibration); --fp16 adds an fp16 engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import enginekit as ek
from enginekit import target

CLASSES = 10
SIZE = 112


def dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images of 10 classes: a smooth per-class prototype plus noise of the same size."""
    rng = np.random.default_rng(1000)
    coarse = rng.standard_normal((CLASSES, 3, 7, 7))
    prototypes = coarse.repeat(SIZE // 7, axis=2).repeat(SIZE // 7, axis=3)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = prototypes[labels] + rng.standard_normal((n, 3, SIZE, SIZE))
    return images.astype(np.float32), labels


def make_model(path: Path) -> Path:
    """ResNet-18 layout at 112x112, BatchNorm fitted to the data, head fitted by ridge regression."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout, momentum=None)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout, momentum=None)
            self.down = (
                nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout, momentum=None)
                )
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + self.down(x))

    widths = (64, 128, 256, 512)
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
        nn.BatchNorm2d(widths[0], momentum=None),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
        cin = w
    body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    head = nn.Linear(cin, CLASSES)
    x, y = dataset(512, seed=0)
    with torch.no_grad():
        body.train()  # BatchNorm statistics: cumulative averages over the data
        for chunk in np.array_split(x, 8):
            body(torch.from_numpy(chunk))
        body.eval()
        feats = np.concatenate([body(torch.from_numpy(c)).numpy() for c in np.array_split(x, 8)])
        # Ridge regression of one-hot labels on standardized features: a fitted classifier. The
        # strong ridge keeps it on high-variance directions (weak ridge interpolates 512 samples
        # with 512 features: 80% accuracy, and margins any feature noise flips).
        mu, sd = feats.mean(0), feats.std(0) + 1e-6
        f = np.hstack([(feats - mu) / sd, np.ones((len(feats), 1))])
        target = np.eye(CLASSES)[y] * 2 - 1
        coef = np.linalg.solve(f.T @ f + 100.0 * np.eye(f.shape[1]), f.T @ target)
        head.weight.copy_(torch.from_numpy((coef[:-1] / sd[:, None]).T.astype(np.float32)))
        head.bias.copy_(torch.from_numpy((coef[-1] - (mu / sd) @ coef[:-1]).astype(np.float32)))
    model = nn.Sequential(body, head).eval()
    return ek.export(model, (torch.from_numpy(x[:2]),), path)


def images_per_s(engine: ek.Engine, x: np.ndarray, rounds: int) -> list[float]:
    calls = max(1, 64 // len(x))
    for _ in range(2):
        engine.infer(x)
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            engine.infer(x)
        out.append(calls * len(x) / (time.perf_counter() - start))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    ap.add_argument("--variants", action="store_true", help="also time the int8 variants tried")
    ap.add_argument("--fp16", action="store_true", help="also time an fp16 engine")
    ap.add_argument("--keep", help="keep the model, table and artifacts in this folder")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="enginekit-int8-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ENGINEKIT_QUIET", "1")

    model_path = work / "resnet18-112-v2.onnx"
    if not model_path.exists():
        t = time.perf_counter()
        make_model(model_path)
        print(f"model: {model_path} ({time.perf_counter() - t:.0f} s to make and export)")
    name = ek.load_model(model_path).inputs[0].name
    calib, _ = dataset(256, seed=2)
    test_x, test_y = dataset(512, seed=3)

    t = time.perf_counter()
    table = ek.calibrate(model_path, calib, method="entropy")
    print(f"calibration: entropy, {table.samples} samples, {len(table)} tensors, "
          f"{time.perf_counter() - t:.1f} s")  # fmt: skip
    shapes = {name: [(1, 3, SIZE, SIZE), (32, 3, SIZE, SIZE), (32, 3, SIZE, SIZE)]}
    common = {"shapes": shapes, "intra_op_threads": args.threads}
    builds: dict[str, dict] = {
        "fp32": {},
        "int8": {"precision": "int8", "calibration": table},
    }
    if args.fp16:
        builds["fp16"] = {"precision": "fp16"}
    if args.variants:
        builds |= {
            "int8 per-tensor": {**builds["int8"], "int8_per_channel": False},
            "int8 8-bit weights": {**builds["int8"], "int8_reduce_range": False},
            "int8 tensorrt-style": {**builds["int8"], "int8_style": "tensorrt"},
            "int8 minmax": {"precision": "int8", "calibration": table.with_method("minmax")},
            "int8 NCHW (extended)": {**builds["int8"], "optimization_level": "extended"},
        }
    engines = {}
    for label, kw in builds.items():
        t = time.perf_counter()
        verify = {"verify_data": test_x[:128]} if "int8" in label else {}
        engines[label] = ek.build(model_path, **common, **kw, **verify)
        print(f"built {label} in {time.perf_counter() - t:.1f} s")

    ref = engines["fp32"].infer({name: test_x})
    ref_top1 = next(iter(ref.values())).argmax(1)
    print(f"\nfp32 accuracy on the held-out set: {(ref_top1 == test_y).mean():.1%}")
    for label, engine in engines.items():
        if label == "fp32":
            continue
        top1 = next(iter(engine.infer({name: test_x}).values())).argmax(1)
        print(f"{label:<22} top-1 agreement with fp32 {(top1 == ref_top1).mean():.2%}, "
              f"accuracy {(top1 == test_y).mean():.1%}")  # fmt: skip

    print(f"\nthroughput, images/s (median of {args.rounds} interleaved rounds):")
    for batch in (1, 32):
        x = {name: test_x[:batch]}
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.rounds):
            for label, engine in engines.items():
                rates[label] += images_per_s(engine, x[name], 1)
        base = statistics.median(rates["fp32"])
        for label in engines:
            med = statistics.median(rates[label])
            ratios = [a / b for a, b in zip(rates[label], rates["fp32"])]
            print(f"  batch {batch:>2}  {label:<22} {med:8.1f}  ratio vs fp32 "
                  f"{med / base:5.2f}x (per-round median {statistics.median(ratios):.2f}x)")  # fmt: skip
    print(f"\nhost: {target.cpu_name()}, ISA {' '.join(sorted(target.cpu_flags()))}")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
