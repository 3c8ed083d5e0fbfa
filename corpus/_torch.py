"""Shared pieces of the PyTorch-based entries: export through enginekit, samples from eager."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from corpus.harness import BATCHES, Entry, Made, Sample

SEED = 0


def _flat(out: Any) -> list[Any]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [v for v in out.values() if v is not None]
    return [v for v in out if v is not None]


def eager(model: Any, feeds: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """The model's own outputs on ``feeds`` (in forward() order), as numpy."""
    import torch

    with torch.no_grad():
        out = model(*(torch.from_numpy(np.ascontiguousarray(a)) for a in feeds.values()))
    return tuple(t.detach().numpy() for t in _flat(out))


def export_torch(
    model: Any,
    folder: Path,
    inputs: Callable[[int, bool], dict[str, np.ndarray]],
    shapes: Mapping[str, Sequence[tuple[int, ...]]],
    dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
) -> Made:
    """Export ``model`` with enginekit (dynamo, dynamic batch and ``dynamic_dims``) and take
    samples from eager PyTorch at batch 1, 3 and the profile's max.

    Args:
        inputs: ``inputs(batch, at_max)`` -> feeds by forward() argument name.
    """
    import torch

    import enginekit as ek

    model = model.eval()
    example = inputs(2, False)
    path = folder / "model.onnx"
    # The harness compares with eager PyTorch itself, at a tolerance relative to each output's
    # scale; the exporter's elementwise check is stricter than float32 reordering allows on
    # deep random-weight networks.
    ek.export(
        model, tuple(torch.from_numpy(a) for a in example.values()), path,
        dynamic_batch=True, dynamic_dims=dynamic_dims, check=False,
    )  # fmt: skip
    samples = []
    for b in BATCHES:
        feeds = inputs(b, b == BATCHES[-1])
        samples.append(Sample(f"b{b}", feeds, eager(model, feeds)))
    return Made(path, shapes, tuple(samples))


def image_inputs(size: int, name: str = "x") -> Callable[[int, bool], dict[str, np.ndarray]]:
    def inputs(batch: int, at_max: bool) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {name: rng.standard_normal((batch, 3, size, size)).astype(np.float32)}

    return inputs


def image_shapes(size: int, name: str = "x") -> dict[str, list[tuple[int, ...]]]:
    lo, opt, hi = 1, BATCHES[1], BATCHES[-1]
    return {name: [(lo, 3, size, size), (opt, 3, size, size), (hi, 3, size, size)]}


def image_entry(
    name: str,
    family: str,
    build: Callable[[], Any],
    size: int = 64,
    packages: tuple[str, ...] = (),
    about: str = "",
) -> Entry:
    """An image classifier (or dense head) taking ``x: [batch, 3, size, size]``."""

    def make(folder: Path) -> Made:
        import torch

        torch.manual_seed(SEED)
        model = build()
        # The ONNX input is named after forward()'s argument (``x``, or ``input`` for some).
        arg = next(iter(inspect.signature(model.forward).parameters))
        return export_torch(model, folder, image_inputs(size, arg), image_shapes(size, arg))

    return Entry(name, family, make, packages, about or f"{size}x{size} images")
