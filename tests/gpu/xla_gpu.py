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
import sys
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
    """Build on ``device`` at ``precision``, reload the artifact, compare with ONNX Runtime CPU
    by the precision's default verification rule (scaled: error relative to each output's
    largest magnitude, and cosine similarity).

    Raises:
        AssertionError: an output differs past the precision's default tolerance.
    """
    import enginekit as ek
    from enginekit.config import default_tolerance
    from enginekit.verify import check_outputs

    tol = default_tolerance(precision)
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
            got = engine.infer(feeds)
            checks = check_outputs(
                got, reference(path, feeds), tol.atol, tol.rtol, min_cosine=tol.min_cosine
            )
            for c in checks:
                assert c.passed, f"{name} {c.name} batch {batch}: {c}"
                worst[c.name] = max(worst.get(c.name, 0.0), c.scaled_error)
    return Report(name, device, precision, batches, worst)


#: The corpus entries the GPU run checks (corpus/): a CNN and a transformer.
CORPUS_MODELS = ("tv-resnet50", "hf-bert")


def corpus_model(name: str, directory: Path) -> tuple[Path, dict[str, Any], Callable[[int], Feeds]]:
    """A corpus entry (random weights), prepared into ``directory``: the ONNX file, the
    entry's own profile (batch 1..8), and inputs at any batch (its first sample's rows
    repeated).

    Raises:
        ModuleNotFoundError: the entry's framework (torchvision, transformers) is missing.
    """
    import importlib

    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import corpus

    entry = corpus.select([name])[0]
    for package in entry.packages:
        importlib.import_module(package)
    prepared = corpus.prepare(entry, cache=directory / "corpus")
    base = prepared.samples[0].feeds

    def feeds(batch: int) -> Feeds:
        return {n: np.repeat(a[:1], batch, axis=0) for n, a in base.items()}

    return prepared.onnx, dict(prepared.shapes), feeds
