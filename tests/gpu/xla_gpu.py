"""The XLA backend's GPU checks, as functions any device can run (tests/gpu/test_gpu_xla.py
calls them on ``cuda``; tests/backends/xla/test_xla_gpu_parts.py on ``cpu``, so the parts a
machine without a GPU can run are tested everywhere).

A check builds a model with ``ek.build(backend="xla", device=..., precision=...)`` (whose own
verification compares with ONNX Runtime CPU), writes and reloads the artifact, and compares the
loaded engine's outputs with ONNX Runtime CPU at several batch sizes, at the precision's
default tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

Feeds = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Report:
    """What one check did: the batches compared and the worst error relative to the output's
    largest magnitude, per output."""

    name: str
    device: str
    precision: str
    batches: tuple[int, ...]
    worst: dict[str, float]


def jax_summary() -> dict[str, Any]:
    """jax, jaxlib and any CUDA plugin installed (versions differ from our pins on GPU images),
    and the devices jax sees; never raises."""
    found: dict[str, Any] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "jax" or name == "jaxlib" or name.startswith("jax-cuda") or "jax_cuda" in name:
            found[name] = dist.version
    try:
        import jax

        found["devices"] = [str(d) for d in jax.devices()]
        try:
            found["gpu"] = [str(d) for d in jax.devices("gpu")]
        except RuntimeError as exc:
            found["gpu"] = f"none ({str(exc).splitlines()[0][:160]})"
    except Exception as exc:  # a broken plugin must not stop the report
        found["error"] = f"{type(exc).__name__}: {exc}"
    return found


def reference(path: Path, feeds: Feeds) -> dict[str, np.ndarray]:
    """ONNX Runtime CPU's outputs on the source model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def check(
    name: str,
    path: Path,
    shapes: Mapping[str, Any],
    feeds_at: Callable[[int], Feeds],
    batches: tuple[int, ...],
    device: str,
    precision: str,
    workdir: Path,
) -> Report:
    """Build on ``device`` at ``precision``, reload the artifact, compare with ONNX Runtime CPU.

    Raises:
        AssertionError: an output differs past the precision's default tolerance.
    """
    import enginekit as ek
    from enginekit.config import DEFAULT_TOLERANCE, Precision

    atol, rtol = DEFAULT_TOLERANCE[Precision(precision)]
    artifact = workdir / f"{name}-{precision}.ekit"
    ek.build(
        path,
        backend="xla",
        shapes=dict(shapes),
        device=device,
        precision=precision,
        output=artifact,
    )
    worst: dict[str, float] = {}
    with ek.load(artifact, device=device) as engine:
        for batch in batches:
            feeds = feeds_at(batch)
            want = reference(path, feeds)
            got = engine.infer(feeds)
            for key, value in want.items():
                np.testing.assert_allclose(
                    got[key], value, atol=atol, rtol=rtol, err_msg=f"{name} {key} batch {batch}"
                )
                scale = max(float(np.abs(value).max()), 1e-30)
                error = float(np.abs(got[key] - value).max()) / scale
                worst[key] = max(worst.get(key, 0.0), error)
    return Report(name, device, precision, batches, worst)


def resnet18(
    directory: Path, size: int = 64
) -> tuple[Path, dict[str, Any], Callable[[int], Feeds]]:
    """torchvision ResNet-18 (random weights), dynamic batch up to 8."""
    import torch

    import enginekit as ek

    lib = torch.library.Library("torchvision", "DEF")  # torchvision's CUDA-built ops need these
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    path = ek.export(
        model, (torch.randn(1, 3, size, size),), directory / "resnet18.onnx", dynamic_batch=True
    )
    name = ek.load_model(path).inputs[0].name
    image = (3, size, size)

    def feeds(batch: int) -> Feeds:
        rng = np.random.default_rng(batch)
        return {name: rng.standard_normal((batch, *image)).astype(np.float32)}

    return path, {name: [(1, *image), (4, *image), (8, *image)]}, feeds


def bert(directory: Path, seq: int = 16) -> tuple[Path, dict[str, Any], Callable[[int], Feeds]]:
    """A 2-layer BERT (transformers, random weights), dynamic batch and sequence."""
    import torch
    import transformers

    import enginekit as ek

    class Bert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(
                vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128,
            )  # fmt: skip
            self.bert = transformers.BertModel(config).eval()

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, seq))
    dims = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    path = ek.export(
        Bert(),
        (ids, torch.ones_like(ids)),
        directory / "bert.onnx",
        dynamic_batch=True,
        dynamic_dims=dims,
    )

    def feeds(batch: int) -> Feeds:
        rng = np.random.default_rng(batch)
        mask = np.ones((batch, seq), np.int64)
        mask[:, seq - 3 :] = 0  # right padding, as a tokenizer writes it
        return {
            "input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
            "attention_mask": mask,
        }

    shapes = {n: [(1, 1), (4, seq), (8, 2 * seq)] for n in ("input_ids", "attention_mask")}
    return path, shapes, feeds
