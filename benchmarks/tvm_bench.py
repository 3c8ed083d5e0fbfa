"""TVM backend vs ONNX Runtime on a ResNet-style CNN, measured side by side in one run.

Rows: ONNX Runtime (default session), TVM NHWC with enginekit's default schedules (untuned),
TVM NHWC tuned with a small MetaSchedule budget, TVM NCHW (untuned), and TVM's stock
schedules (``schedule="none"``, batch 1 only: it is tens of times slower). Columns: build
(compile) and tuning seconds, median latency per batch size, and the ratio to ONNX Runtime.

    python benchmarks/tvm_bench.py                       # 64x64 inputs, batches 1 and 32, 32 trials
    python benchmarks/tvm_bench.py --size 112 --trials 64 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def resnet(channels: tuple[int, ...] = (32, 64, 128, 256)) -> object:
    """A small ResNet: stem, four residual stages (stride 2 after the first), head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + self.skip(x))

    layers = [
        nn.Conv2d(3, channels[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(channels[0]),
        nn.ReLU(),
    ]
    cin = channels[0]
    for i, cout in enumerate(channels):
        layers.append(Block(cin, cout, 1 if i == 0 else 2))
        cin = cout
    torch.manual_seed(0)
    body = nn.Sequential(*layers)
    head = nn.Linear(cin, 10)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = body, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x).mean((2, 3)))

    return Net().eval()


def latency_ms(engines: dict, feeds: dict, rounds: int) -> dict[str, float]:
    """Median per-call latency of each engine, the engines interleaved round by round; each
    round times enough calls of an engine to last ~0.1 s."""
    calls = {}
    for name, engine in engines.items():
        engine.infer(feeds)  # warm up
        start = time.perf_counter()
        engine.infer(feeds)
        calls[name] = max(1, min(50, int(0.1 / (time.perf_counter() - start))))
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                engine.infer(feeds)
            samples[name].append((time.perf_counter() - start) / calls[name] * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    import torch

    import enginekit as ek

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=int, default=64, help="input height and width (default 64)")
    ap.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    ap.add_argument("--trials", type=int, default=32, help="tuning trials per batch size (0: skip)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)
    tmp = Path(tempfile.mkdtemp(prefix="enginekit-bench-tvm-"))
    path = ek.export(
        resnet(), (torch.randn(1, 3, args.size, args.size),), tmp / "resnet.onnx",
        dynamic_dims={"x": {0: "batch"}},
    )  # fmt: skip
    full = (top, 3, args.size, args.size)
    shapes = {"x": [(1, 3, args.size, args.size), full, full]}
    configs: dict[str, dict] = {
        "onnxruntime": {"backend": "onnxruntime"},
        "tvm NHWC": {"backend": "tvm", "layout": "NHWC"},
        "tvm NCHW": {"backend": "tvm", "layout": "NCHW"},
    }
    if args.trials:
        configs[f"tvm NHWC tuned ({args.trials} trials)"] = {
            "backend": "tvm",
            "layout": "NHWC",
            "tune": {"trials": args.trials, "batch_sizes": batches},
            "tuning_db": str(tmp / "tvm-db"),
        }
    configs["tvm NHWC, stock schedules"] = {"backend": "tvm", "schedule": "none"}
    engines, build_s, tune_s = {}, {}, {}
    for name, options in configs.items():
        start = time.perf_counter()
        engines[name] = ek.build(path, shapes=shapes, **options)
        build_s[name] = time.perf_counter() - start
        tuning = engines[name].manifest["backend"].get("metadata", {}).get("tuning")
        tune_s[name] = tuning["seconds"] if tuning else 0.0
        print(f"built {name}: {build_s[name]:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    results: dict[int, dict[str, float]] = {}
    for batch in batches:
        feeds = {"x": rng.standard_normal((batch, 3, args.size, args.size)).astype(np.float32)}
        pick = {n: e for n, e in engines.items() if batch == 1 or "stock" not in n}
        results[batch] = latency_ms(pick, feeds, args.rounds)
    print(
        f"\nResNet-style CNN, {args.size}x{args.size} inputs, medians of interleaved rounds "
        f"(lower is better); ratio = latency / ONNX Runtime's"
    )
    header = f"{'engine':34s} {'build s':>8s} {'tune s':>7s}" + "".join(
        f" {'b' + str(b) + ' ms':>10s} {'ratio':>6s}" for b in batches
    )
    print(header)
    print("-" * len(header))
    for name in engines:
        row = f"{name:34s} {build_s[name] - tune_s[name]:8.1f} {tune_s[name]:7.1f}"
        for b in batches:
            ms = results[b].get(name)
            ratio = ms / results[b]["onnxruntime"] if ms is not None else None
            row += f" {ms:10.2f} {ratio:6.2f}" if ms is not None else f" {'skipped':>10s} {'':>6s}"
        print(row)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
