"""Tiny models the tests build themselves: an MLP, a CNN, a two-input model, a transformer layer.

Each is exported once per test session through enginekit's own PyTorch exporter (so the export
path is exercised too) and cached in a session temp dir. Inputs, profiles and batch sizes for
the conformance suite live here with them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance model: how to make it and the shapes to build and run it at."""

    name: str
    shapes: dict[str, Any]  # build shapes: input -> [min, opt, max]
    dynamic_dims: dict[str, dict[int, str]]
    max_batch: int

    def feeds(self, batch: int, seed: int = 0, seq: int | None = None) -> dict[str, np.ndarray]:
        """Random inputs with ``batch`` rows (and ``seq`` tokens for sequence inputs)."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, (_lo, opt, _) in self.shapes.items():
            shape = list(opt)
            shape[0] = batch
            if seq is not None and len(shape) > 1 and 1 in self.dynamic_dims.get(name, {}):
                shape[1] = seq
            if name == "ids":
                out[name] = rng.integers(0, 50, shape).astype(np.int64)
            elif name == "mask":
                m = np.ones(shape, np.float32)
                m[:, shape[1] // 2 + 1 :] = 0.0
                out[name] = m
            else:
                out[name] = rng.standard_normal(shape).astype(np.float32)
        return out


CASES = {
    "mlp": Case("mlp", {"x": [(1, 16), (8, 16), (16, 16)]}, {}, 16),
    "cnn": Case("cnn", {"x": [(1, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16)]}, {}, 8),
    "two_input": Case(
        "two_input", {"a": [(1, 8), (4, 8), (8, 8)], "b": [(1, 4), (4, 4), (8, 4)]}, {}, 8
    ),
    "transformer": Case(
        "transformer",
        {"ids": [(1, 2), (4, 8), (8, 12)], "mask": [(1, 2), (4, 8), (8, 12)]},
        {"ids": {1: "seq"}, "mask": {1: "seq"}},
        8,
    ),
}


def make_torch_model(name: str) -> Any:
    """The PyTorch module behind a case, with fixed random weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            )
            self.head = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    class TwoInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(12, 6)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(torch.cat([a, b], dim=1))
            return torch.tanh(h), a.sum(dim=1, keepdim=True) * b.mean(dim=1, keepdim=True)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.head = nn.Linear(32, 3)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            bias = (1.0 - mask)[:, None, None, :] * -1e4
            bias = bias.expand(-1, 4, ids.shape[1], -1).reshape(-1, ids.shape[1], ids.shape[1])
            return self.head(self.layer(h, src_mask=bias))

    model = {"mlp": MLP, "cnn": CNN, "two_input": TwoInput, "transformer": Encoder}[name]()
    if name == "cnn":  # non-trivial BatchNorm statistics, so folding it is really tested
        bn = model.body[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def export_case(name: str, directory: Path) -> Path:
    """Export a case's PyTorch model with enginekit and return the ONNX path."""
    import torch

    import enginekit as ek

    case = CASES[name]
    feeds = case.feeds(case.shapes[next(iter(case.shapes))][1][0])
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    return ek.export(
        make_torch_model(name), args, directory / f"{name}.onnx", dynamic_dims=case.dynamic_dims
    )
