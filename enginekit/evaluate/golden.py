"""Golden files: input sets and the reference outputs for them, in one ``.npz``.

Made where the reference runs (``enginekit compare model.onnx --save-golden g.npz`` on a CPU
machine), read where the engine runs (``--golden g.npz`` on a GPU machine), so both are held to
the same numbers. Arrays only, read with ``allow_pickle=False``; names and provenance live in
a JSON string under the key ``meta``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from enginekit import target
from enginekit.errors import UsageError
from enginekit.files import atomic_write
from enginekit.model import Model
from enginekit.version import __version__

log = logging.getLogger(__name__)

FORMAT = "enginekit.golden/1"

Feeds = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Golden:
    """Input sets and reference outputs, index-aligned; ``reference`` names what made them."""

    inputs: tuple[Feeds, ...]
    outputs: tuple[Feeds, ...]
    reference: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def save_golden(path: str | os.PathLike, golden: Golden, model: Model | None = None) -> Path:
    """Write ``golden`` to ``path`` (.npz) atomically; returns the path."""
    path = Path(path)
    if not golden.inputs:
        raise UsageError("a golden file needs at least one input set")
    in_names = list(golden.inputs[0])
    out_names = list(golden.outputs[0])
    meta = {
        "format": FORMAT,
        "enginekit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "reference": golden.reference,
        "model_sha256": model.sha256 if model is not None else None,
        "inputs": in_names,
        "outputs": out_names,
        "cases": len(golden.inputs),
        "host": target.host(),
    }
    arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta))}
    for c, (feeds, outs) in enumerate(zip(golden.inputs, golden.outputs)):
        for i, n in enumerate(in_names):
            arrays[f"in_{c}_{i}"] = np.asarray(feeds[n])
        for j, n in enumerate(out_names):
            arrays[f"out_{c}_{j}"] = np.asarray(outs[n])
    with atomic_write(path, suffix=".npz") as f:
        np.savez_compressed(f, **arrays)  # type: ignore[arg-type]
    return path


def load_golden(path: str | os.PathLike, model: Model | None = None) -> Golden:
    """Read a golden file written by :func:`save_golden`.

    A golden file made from a different model (SHA-256) is read with a warning: a re-export
    of the same weights changes the bytes but not the outputs, so the check decides.

    Raises:
        UsageError: the file is missing, not an .npz, or not a golden file.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"golden file {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"golden file {str(path)!r} is not a readable .npz: {exc}") from None
    try:
        meta = json.loads(str(arrays["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        in_names, out_names = list(meta["inputs"]), list(meta["outputs"])
        inputs = tuple(
            {n: arrays[f"in_{c}_{i}"] for i, n in enumerate(in_names)} for c in range(meta["cases"])
        )
        outputs = tuple(
            {n: arrays[f"out_{c}_{j}"] for j, n in enumerate(out_names)}
            for c in range(meta["cases"])
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise UsageError(
            f"golden file {str(path)!r} is not an enginekit golden file ({exc}); make one with "
            "enginekit compare MODEL --save-golden FILE.npz"
        ) from None
    if model is not None:
        _check_model(path, meta, model, in_names, out_names)
    return Golden(inputs, outputs, f"golden {path.name} ({meta['reference']})", meta)


def _check_model(
    path: Path, meta: Mapping[str, Any], model: Model, in_names: list[str], out_names: list[str]
) -> None:
    want_in = sorted(s.name for s in model.inputs)
    want_out = sorted(s.name for s in model.outputs)
    if sorted(in_names) != want_in or not set(out_names) <= set(want_out):
        raise UsageError(
            f"golden file {str(path)!r} has inputs {in_names} and outputs {out_names}; the model "
            f"has inputs {want_in} and outputs {want_out}. Make it from this model."
        )
    if meta.get("model_sha256") not in (None, model.sha256):
        log.warning(
            "golden file %s was made from a model with SHA-256 %s, this one is %s",
            path,
            str(meta.get("model_sha256"))[:16],
            model.sha256[:16],
        )
