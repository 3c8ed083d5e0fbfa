"""Accuracy of a reduced-precision engine against the float32 model, on real data.

Random inputs say little about an INT8 engine (its error is set by the calibrated ranges, and
random data falls outside them), so the build verifies INT8 on held-out calibration samples
(or ``verify_data``): per output the max and mean absolute error, and for classifier-shaped
outputs (rank 2, ``[batch, classes]``) how often the top-1 class agrees. Gates turn the report
into a pass or a VerificationError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from enginekit.engine import Engine
from enginekit.errors import BuildError
from enginekit.model import Model, reference_session


@dataclasses.dataclass(frozen=True)
class Gates:
    """Limits an engine must meet on the verification data; None means not checked.

    Attributes:
        min_top1_agreement: lowest fraction (0..1) of rows whose argmax matches the float32
            model, for every classifier-shaped output.
        max_abs_error: largest absolute difference allowed on any output element.
    """

    min_top1_agreement: float | None = None
    max_abs_error: float | None = None

    def __post_init__(self) -> None:
        t = self.min_top1_agreement
        if t is not None and not 0.0 <= t <= 1.0:
            raise BuildError(f"min_top1_agreement={t}: expected a fraction in [0, 1], e.g. 0.99")
        if self.max_abs_error is not None and not self.max_abs_error >= 0:
            raise BuildError(f"max_abs_error={self.max_abs_error}: expected a number >= 0")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_classifier(shape: tuple[int, ...]) -> bool:
    """Rank 2 with at least two classes: ``[batch, classes]``."""
    return len(shape) == 2 and shape[1] >= 2


class _Stats:
    def __init__(self) -> None:
        self.max_abs = 0.0
        self.scale = 0.0
        self.dot = self.norm_g = self.norm_r = 0.0
        self.sum_abs = 0.0
        self.count = 0
        self.agree = 0
        self.rows = 0
        self.classifier = True
        self.nan = False

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        g, r = got.astype(np.float64), ref.astype(np.float64)
        if g.shape != r.shape:
            raise BuildError(f"engine output shape {g.shape} differs from the reference {r.shape}")
        diff = np.abs(g - r)
        if np.isnan(diff).any() and not np.array_equal(np.isnan(g), np.isnan(r)):
            self.nan = True
        diff = np.nan_to_num(diff, nan=0.0, posinf=np.inf)
        finite = np.isfinite(g) & np.isfinite(r)
        if finite.any():
            self.scale = max(self.scale, float(np.abs(r[finite]).max()))
            gf, rf = g[finite], r[finite]
            self.dot += float(np.dot(gf, rf))
            self.norm_g += float(np.dot(gf, gf))
            self.norm_r += float(np.dot(rf, rf))
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.sum())
            self.count += diff.size
        self.classifier = self.classifier and is_classifier(r.shape)
        if self.classifier and r.shape[0]:
            self.agree += int((g.argmax(axis=1) == r.argmax(axis=1)).sum())
            self.rows += r.shape[0]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / self.count if self.count else 0.0,
            "scale": self.scale,
            "scaled_error": _finite_or_none(
                self.max_abs / self.scale if self.scale else (0.0 if not self.max_abs else None)
            ),
            "cosine": _cosine(self.dot, self.norm_g, self.norm_r),
        }
        if self.classifier and self.rows:
            out["top1_agreement"] = self.agree / self.rows
            out["rows"] = self.rows
        if self.nan:
            out["error"] = "NaN where the reference has a number"
        return out


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else float(value)


def _cosine(dot: float, ng2: float, nr2: float) -> float | None:
    """Cosine similarity from accumulated sums (1 for two zero outputs, 0 for one)."""
    if ng2 == 0.0 and nr2 == 0.0:
        return 1.0
    if ng2 == 0.0 or nr2 == 0.0:
        return 0.0
    return _finite_or_none(dot / float(np.sqrt(ng2) * np.sqrt(nr2)))


def accuracy_report(
    engine: Engine,
    model: Model,
    batches: Iterable[Mapping[str, np.ndarray]],
    gates: Gates,
    data: str,
) -> dict[str, Any]:
    """Compare ``engine`` with the float32 model on ``batches`` and apply ``gates``.

    Returns:
        ``{"passed", "kind": "accuracy", "reference", "data", "samples", "outputs": {name:
        {"max_abs", "mean_abs", "scale", "scaled_error", "cosine", "top1_agreement"?,
        "rows"?}}, "gates", "failures"}`` (``scale`` is ``max|ref|``, ``scaled_error``
        ``max_abs / scale``: docs/verification.md).

    Raises:
        BuildError: a top-1 gate was set but no output is classifier-shaped.
    """
    session = reference_session(model)
    names = [o.name for o in model.outputs]
    stats = {n: _Stats() for n in names}
    samples = 0
    for feeds in batches:
        ref = dict(zip(names, session.run(names, dict(feeds))))
        got = engine.infer(feeds)
        for n in names:
            stats[n].add(got[n], ref[n])
        first = next(iter(feeds.values()))
        samples += int(first.shape[0]) if first.ndim else 1
    outputs = {n: s.to_json() for n, s in stats.items()}
    failures = []
    for n, o in outputs.items():
        if "error" in o:
            failures.append(f"output {n!r}: {o['error']}")
        if gates.max_abs_error is not None and o["max_abs"] > gates.max_abs_error:
            failures.append(
                f"output {n!r}: max abs error {o['max_abs']:.4g} > max_abs_error "
                f"{gates.max_abs_error:g}"
            )
        t = gates.min_top1_agreement
        if t is not None and "top1_agreement" in o and o["top1_agreement"] < t:
            failures.append(
                f"output {n!r}: top-1 agreement {o['top1_agreement']:.2%} < min_top1_agreement "
                f"{t:.2%} ({o['rows']} rows)"
            )
    if gates.min_top1_agreement is not None and not any(
        "top1_agreement" in o for o in outputs.values()
    ):
        raise BuildError(
            "min_top1_agreement is set, but no output is classifier-shaped ([batch, classes]) "
            f"on the verification data (outputs: {', '.join(names)}); use max_abs_error instead"
        )
    return {
        "passed": not failures,
        "kind": "accuracy",
        "reference": "onnxruntime-cpu float32 source model",
        "data": data,
        "samples": samples,
        "outputs": outputs,
        "gates": gates.to_json(),
        "failures": failures,
    }


def summarize(report: Mapping[str, Any]) -> str:
    """One clause per output: errors and top-1 agreement (for logs and CLI output)."""
    parts = []
    for n, o in report.get("outputs", {}).items():
        text = f"{n}: max abs {o['max_abs']:.3g}, mean abs {o['mean_abs']:.3g}"
        if o.get("scaled_error") is not None:
            text += f" ({o['scaled_error']:.3g} of the output's scale)"
        if o.get("cosine") is not None:
            text += f", cosine {o['cosine']:.5f}"
        if "top1_agreement" in o:
            text += f", top-1 agreement {o['top1_agreement']:.2%} of {o['rows']}"
        parts.append(text)
    return "; ".join(parts)


Feeds = Mapping[str, np.ndarray]


def _session(proto: onnx.ModelProto, threads: int = 0) -> Any:
    import onnxruntime as ort

    from enginekit.model import ort_severity, quiet_onnxruntime

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    quiet_onnxruntime()
    opts.log_severity_level = ort_severity()
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ort_runner(proto: onnx.ModelProto) -> Callable[[Feeds], Sequence[np.ndarray]]:
    """A runner over an ONNX Runtime CPU session: feeds -> outputs in graph order."""
    session = _session(proto)
    return lambda feeds: session.run(None, dict(feeds))
