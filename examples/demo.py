"""enginekit's main job, end to end: PyTorch CNN -> ONNX -> ONNX Runtime engine -> inference.

Run with `make demo`. Prints how closely the engine agrees with PyTorch and its throughput
(``--seconds`` per throughput measurement, default 1). Writes into ./demo-out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import enginekit as ek


class SmallCNN(nn.Module):
    """A small image classifier: 3x32x32 -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def throughput(fn, batch: int, seconds: float = 1.0) -> float:
    """Samples per second of ``fn`` over about ``seconds``."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return calls * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per throughput measurement")
    seconds = parser.parse_args().seconds
    torch.manual_seed(0)
    model = SmallCNN().eval()
    work = Path("demo-out")
    work.mkdir(exist_ok=True)

    onnx_path = ek.export(
        model, (torch.randn(1, 3, 32, 32),), work / "cnn.onnx", dynamic_batch=True
    )
    print(f"exported   {onnx_path}")

    ek.build(
        onnx_path,
        backend="onnxruntime",
        shapes={"x": [(1, 3, 32, 32), (16, 3, 32, 32), (64, 3, 32, 32)]},
        output=work / "cnn.ekit",
    ).close()
    engine = ek.load(work / "cnn.ekit")
    print(f"built      {work / 'cnn.ekit'}: {engine}")
    verify = engine.manifest["verify"]
    worst = max(o["max_abs"] for c in verify["cases"] for o in c["outputs"].values())
    print(f"verified   at build time against ONNX Runtime CPU: max abs error {worst:.2e}")

    batch = np.random.default_rng(0).standard_normal((32, 3, 32, 32)).astype(np.float32)
    logits = engine.infer({"x": batch})["output"]
    with torch.no_grad():
        expected = model(torch.from_numpy(batch)).numpy()
    agree = float((logits.argmax(1) == expected.argmax(1)).mean())
    print(
        f"inference  batch of 32 -> {logits.shape}; max abs diff vs PyTorch {np.abs(logits - expected).max():.2e}, top-1 agreement {agree:.0%}"
    )

    ek_rate = throughput(lambda: engine.infer(batch), len(batch), seconds)
    with torch.no_grad():
        pt_rate = throughput(lambda: model(torch.from_numpy(batch)), len(batch), seconds)
    print(
        f"throughput enginekit {ek_rate:,.0f} images/s, PyTorch eager {pt_rate:,.0f} images/s ({ek_rate / pt_rate:.2f}x)"
    )
    engine.close()


if __name__ == "__main__":
    main()
