"""The accuracy gate ``--backend auto`` holds reduced-precision candidates to: top-1 agreement
with the float32 model on one shared verification batch.

Every candidate that passed its own build verification runs the same batch; its outputs are
compared with the float32 reference's (ONNX Runtime CPU on the source model). An output counts
when it is floating point with a class-like last axis (more than one entry): its arg-max along
that axis is compared row by row — classes for a classifier, the strongest hidden unit per token
for an encoder. fp32 candidates are reported, not gated: the verification rule already holds
them to the reference.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from enginekit import target
from enginekit.engine import Engine
from enginekit.model import Model, concrete_shapes, reference_session

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]

#: The floor when the user gives none (``min_top1_agreement=``): at most 1 row in 100 may pick
#: a different class than the float32 model.
DEFAULT_MIN_TOP1 = 0.99
#: Rows of the shared batch at most (held-out calibration rows can be many).
MAX_ROWS = 256
#: ISA flags that give a CPU native bf16 arithmetic (dot products and conversions).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How one engine's outputs agree with the float32 reference on the shared batch.

    Attributes:
        top1: the lowest top-1 agreement over the gated outputs (None: no output has a
            class-like last axis).
        cosine: the lowest mean per-row cosine similarity over float outputs (None: none).
        rows: rows compared (of the first gated output, or the batch's).
    """

    top1: float | None
    cosine: float | None
    rows: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def host_precisions(device: str, calibrated: bool) -> tuple[list[str], dict[str, str]]:
    """The precisions auto tries by default on ``device``, and why each other one is left out.

    fp32 always; bf16 where the CPU has bf16 instructions (emulated bf16 is slower than fp32);
    int8 with calibration data (or a table). fp16 is left out on CPU: no x86 backend here runs
    it faster than fp32.
    """
    chosen = ["fp32"]
    left: dict[str, str] = {}
    if device.startswith("cuda"):
        chosen += ["fp16", "bf16"]
    elif BF16_FLAGS & target.cpu_flags():
        chosen.append("bf16")
    else:
        left["bf16"] = "this CPU has no bf16 instructions (avx512_bf16, amx_bf16)"
    if not device.startswith("cuda"):
        left["fp16"] = "no CPU backend runs fp16 faster than fp32 on x86"
    if calibrated:
        chosen.append("int8")
    else:
        left["int8"] = "no calibration data (calib_data= / --calib-data, or calibration=)"
    return chosen, left


def _reiterable(data: Any) -> bool:
    """Whether reading ``data`` here leaves it whole for the builds (not a one-shot iterator)."""
    try:
        return iter(data) is not data
    except TypeError:
        return True  # arrays, paths, mappings: read again by each build


def batch(
    model: Model,
    profile: Mapping[str, Any] | None,
    batch_size: int,
    verify_data: Any = None,
    calib_data: Any = None,
    seed: int = 0,
) -> tuple[list[Feeds], str]:
    """The shared batch (as the chunks the model takes: a fixed-batch model's rows stay cut
    to its batch) and what it is: ``verify_data``'s first rows, else the rows a build holds
    out of ``calib_data`` (every 10th, never calibrated on), else generated inputs at
    ``batch_size`` rows."""
    from enginekit.calibration.data import DEFAULT_BATCH, Holdout, batches

    if verify_data is not None and _reiterable(verify_data):
        got = _rows(batches(verify_data, model.inputs, DEFAULT_BATCH, MAX_ROWS, profile))
        if got is not None:
            return got, "verify_data"
    if calib_data is not None and _reiterable(calib_data):
        holdout = Holdout(every=10, cap=MAX_ROWS)
        for _ in holdout.split(batches(calib_data, model.inputs, DEFAULT_BATCH, None, profile)):
            pass
        got = _rows(batches(holdout.held, model.inputs, DEFAULT_BATCH, MAX_ROWS, profile))
        if got is not None:
            return got, f"{_count(got)} calibration rows held out (every 10th)"
    from enginekit.feeds import make_feeds

    shapes = concrete_shapes(model.inputs, profile, "opt")
    shapes = {n: (batch_size, *s[1:]) if s else s for n, s in shapes.items()}
    return [make_feeds(model, shapes, seed=seed)], f"generated inputs ({batch_size} rows)"


def _rows(stream: Iterator[Feeds]) -> list[Feeds] | None:
    parts = list(stream)
    return parts or None


def _count(chunks: list[Feeds]) -> int:
    return sum(len(next(iter(c.values()))) for c in chunks)


def reference(model: Model, chunks: list[Feeds]) -> dict[str, np.ndarray]:
    """The float32 reference's outputs on ``chunks``, joined (ONNX Runtime CPU on the source
    model)."""
    session = reference_session(model)
    names = [o.name for o in session.get_outputs()]
    return _join([dict(zip(names, session.run(names, c))) for c in chunks])


def _join(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}


def measure(engine: Engine, chunks: list[Feeds], ref: Mapping[str, np.ndarray]) -> Agreement:
    """Top-1 agreement and cosine similarity of ``engine`` against ``ref`` on ``chunks``."""
    got = _join([engine.infer(c) for c in chunks])
    top1s, cosines, rows = [], [], 0
    for name, r in ref.items():
        g = got.get(name)
        if g is None or r.dtype.kind != "f" or g.shape != r.shape or r.ndim < 1:
            continue
        g64 = np.asarray(g, np.float64).reshape(r.shape[0] if r.ndim > 1 else 1, -1)
        r64 = np.asarray(r, np.float64).reshape(g64.shape)
        norms = np.linalg.norm(g64, axis=1) * np.linalg.norm(r64, axis=1)
        cosines.append(float(np.mean((g64 * r64).sum(1) / np.maximum(norms, 1e-30))))
        if r.ndim >= 2 and r.shape[-1] > 1:
            a = np.nan_to_num(np.asarray(g, np.float64), nan=-np.inf).reshape(-1, r.shape[-1])
            b = r.reshape(-1, r.shape[-1])
            top1s.append(float(np.mean(a.argmax(1) == b.argmax(1))))
            rows = rows or a.shape[0]
    return Agreement(
        min(top1s) if top1s else None,
        min(cosines) if cosines else None,
        rows or _count(chunks),
    )


def gate(precision: str, agreement: Agreement, floor: float) -> str | None:
    """Why a candidate fails the accuracy gate, or None: reduced precisions (not fp32) must
    keep ``floor`` top-1 agreement with the float32 model."""
    if precision == "fp32" or agreement.top1 is None or agreement.top1 >= floor:
        return None
    return (
        f"{precision}: top-1 agreement with float32 {agreement.top1:.2%} on the shared batch "
        f"({agreement.rows} rows) is below {floor:.2%} (min_top1_agreement=)"
    )
