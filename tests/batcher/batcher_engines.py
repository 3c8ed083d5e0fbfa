"""What the batcher tests run on: real ONNX Runtime engines of the tiny test models, and a
wrapping Engine that records each batch, can hold batches at a gate, and raises on a marked row.

The wrapper is the batcher's collaborator under control (to build up a queue on purpose, or to
make one batch fail); the outputs it returns are the real engine's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from models import CASES

import enginekit as ek

POISON = 666.0  # a CNN row whose first pixel is this makes Held raise
BLOCK = 777.0  # a row whose first pixel is this holds its batch in Blocking until the gate opens


def build(onnx_model: Any, name: str) -> ek.Engine:
    return ek.build(onnx_model(name), shapes=CASES[name].shapes)


def rows(n: int, seed: int = 0) -> np.ndarray:
    """``n`` CNN rows (3x16x16), each marked with its index in its first pixel."""
    x = np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)
    x[:, 0, 0, 0] = np.arange(n) + 1000 * seed
    return x


class Held(ek.Engine):
    """Runs ``inner``; records the marks of every batch; waits at ``gate``; raises on POISON."""

    def __init__(self, inner: ek.Engine, manifest: dict | None = None) -> None:
        super().__init__(inner.inputs, inner.outputs, inner.profiles, manifest or inner.manifest)
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.batches: list[list[float]] = []

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        first = next(iter(feeds.values()))
        marks = first.reshape(len(first), -1)[:, 0].tolist()
        self.batches.append(marks)
        self.started.set()
        if not self.gate.wait(30):
            raise RuntimeError("test gate never opened")
        if POISON in marks:
            raise RuntimeError("poisoned row in this batch")
        return self.inner.infer(feeds)

    def hold(self) -> None:
        self.gate.clear()
        self.started.clear()


class Blocking(ek.Engine):
    """Runs ``inner`` (after ``delay`` seconds); a batch with a BLOCK row waits at ``gate``;
    claims ``manifest`` (what the Batcher reads to count the calls it can run side by side)."""

    def __init__(self, inner: ek.Engine, manifest: dict, delay: float = 0.0) -> None:
        super().__init__(inner.inputs, inner.outputs, inner.profiles, manifest)
        self.inner = inner
        self.delay = delay
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        first = next(iter(feeds.values()))
        if BLOCK in first.reshape(len(first), -1)[:, 0]:
            self.blocked.set()
            if not self.gate.wait(30):
                raise RuntimeError("test gate never opened")
        if self.delay:
            time.sleep(self.delay)
        return self.inner.infer(feeds)


def ort_cpu(threads: int, **options: object) -> dict:
    """The manifest of an ONNX Runtime CPU build with ``intra_op_threads=threads``."""
    return {
        "backend": {"name": "onnxruntime", "metadata": {"providers": ["CPUExecutionProvider"]}},
        "config": {"options": {"intra_op_threads": threads, **options}},
    }
