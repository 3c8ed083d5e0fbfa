"""Numerical checks of an engine against a reference (ONNX Runtime CPU on the source model).

:func:`check_output` measures one output against its reference (max abs/rel error, error
percentiles, cosine similarity, top-k agreement for classifier-shaped outputs) and decides pass
or fail at ``|engine - ref| <= atol + rtol * |ref|``. :func:`verify_engine` is the build-time
check; :mod:`enginekit.evaluate.compare` runs the same checks across backends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import BuildConfig, ShapeProfile
from enginekit.engine import Engine
from enginekit.model import Model, concrete_shapes, random_feeds, reference_session

#: Top-k agreement is reported for outputs shaped [batch, classes] with more classes than k.
DEFAULT_TOPK = 5


def _num(value: float | None) -> float | None:
    """A float for JSON: non-finite values (inf, NaN) become None (strict JSON has neither)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    """How one engine output compares with the reference output of the same name.

    Attributes:
        name: the output's name.
        passed: every element within ``atol + rtol * |ref|``, no NaN the reference lacks, and
            the optional cosine / top-1 floors met.
        shape: the reference output's shape.
        allclose: every element within ``atol + rtol * |ref|`` (the tolerance alone).
        max_abs, max_rel, mean_abs: largest absolute and relative error, mean absolute error
            (``inf`` when an element is NaN on one side only).
        p50_abs, p90_abs, p99_abs: percentiles of the absolute error.
        mismatch: fraction of elements outside the tolerance.
        cosine: cosine similarity of engine and reference output, over finite elements.
        top1: for [batch, classes] outputs, the fraction of rows whose arg-max agrees.
        topk: the mean overlap of the top-``k`` class sets (when there are more than k classes).
        k: the k of ``topk``.
        nan: NaN elements in the engine output; ref_nan: in the reference.
        worst: index of the element with the largest absolute error.
        error: why it failed, in words (None when it passed or the numbers say it all).
    """

    name: str
    passed: bool
    shape: tuple[int, ...] = ()
    allclose: bool = False
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    p50_abs: float = 0.0
    p90_abs: float = 0.0
    p99_abs: float = 0.0
    mismatch: float = 0.0
    cosine: float | None = None
    top1: float | None = None
    topk: float | None = None
    k: int | None = None
    nan: int = 0
    ref_nan: int = 0
    worst: tuple[int, ...] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict; non-finite numbers become null."""
        out: dict[str, Any] = {
            "passed": self.passed,
            "allclose": self.allclose,
            "shape": list(self.shape),
        }
        for key in ("max_abs", "max_rel", "mean_abs", "p50_abs", "p90_abs", "p99_abs"):
            out[key] = _num(getattr(self, key))
        out["mismatch"] = self.mismatch
        out["cosine"] = _num(self.cosine)
        out["top1"] = self.top1
        if self.topk is not None:
            out["topk"] = self.topk
            out["k"] = self.k
        out["nan"] = self.nan
        out["ref_nan"] = self.ref_nan
        out["worst"] = None if self.worst is None else list(self.worst)
        if self.error:
            out["error"] = self.error
        return out


def _cosine(g: np.ndarray, r: np.ndarray) -> float | None:
    keep = np.isfinite(g) & np.isfinite(r)
    if not keep.any():
        return None
    g, r = g[keep], r[keep]
    ng, nr = float(np.linalg.norm(g)), float(np.linalg.norm(r))
    if ng == 0.0 and nr == 0.0:
        return 1.0
    if ng == 0.0 or nr == 0.0:
        return 0.0
    return float(np.dot(g, r) / (ng * nr))


def _top_agreement(
    g: np.ndarray, r: np.ndarray, k: int
) -> tuple[float | None, float | None, int | None]:
    """(top-1 agreement, top-k overlap, k) for [batch, classes] float outputs, else Nones."""
    if g.ndim != 2 or g.shape[1] < 2 or g.shape[0] == 0:
        return None, None, None
    # NaN would win arg-max on one side only; rank it last so the disagreement shows as usual.
    g = np.where(np.isnan(g), -np.inf, g)
    r = np.where(np.isnan(r), -np.inf, r)
    top1 = float(np.mean(np.argmax(g, axis=1) == np.argmax(r, axis=1)))
    if k < 1 or g.shape[1] <= k:
        return top1, None, None
    gk = np.argsort(-g, axis=1, kind="stable")[:, :k]
    rk = np.argsort(-r, axis=1, kind="stable")[:, :k]
    overlap = (gk[:, :, None] == rk[:, None, :]).any(axis=2).sum(axis=1) / k
    return top1, float(np.mean(overlap)), k


def check_output(
    name: str,
    got: np.ndarray | None,
    ref: np.ndarray,
    atol: float,
    rtol: float,
    *,
    equal_nan: bool = False,
    topk: int = DEFAULT_TOPK,
    min_cosine: float | None = None,
    min_top1: float | None = None,
) -> OutputCheck:
    """Compare one engine output with its reference.

    Args:
        name: the output's name (for the report).
        got, ref: engine and reference arrays; a missing ``got`` or a shape mismatch fails.
        atol, rtol: an element passes when ``|got - ref| <= atol + rtol * |ref|``.
        equal_nan: whether NaN in both at the same place agrees. NaN in the engine output where
            the reference has a number always fails; equal infinities always agree.
        topk: k of the top-k agreement for [batch, classes] outputs.
        min_cosine, min_top1: optional extra floors the output must also meet.
    """
    ref = np.asarray(ref)
    if got is None:
        return OutputCheck(
            name, False, tuple(ref.shape), error="the engine returned no such output"
        )
    got = np.asarray(got)
    if got.shape != ref.shape:
        return OutputCheck(
            name, False, tuple(ref.shape), error=f"shape {got.shape} vs reference {ref.shape}"
        )
    if ref.size == 0:
        return OutputCheck(name, True, tuple(ref.shape), allclose=True)
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    g_nan, r_nan = np.isnan(g), np.isnan(r)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(g - r)
    diff[g == r] = 0.0  # equal infinities: inf - inf would be NaN
    diff[g_nan & r_nan] = 0.0 if equal_nan else np.inf
    diff[np.isnan(diff)] = np.inf  # NaN on one side only
    # An infinite reference would make the bound infinite and let any value through.
    bound = np.where(np.isfinite(r), atol + rtol * np.abs(r), 0.0)
    within = diff <= bound
    with np.errstate(divide="ignore", invalid="ignore"):  # inf errors make inf/NaN, on purpose
        rel = diff / np.maximum(np.abs(r), np.finfo(np.float32).tiny)
        p50, p90, p99 = (float(v) for v in np.percentile(diff, [50, 90, 99], method="nearest"))
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    cosine = _cosine(g, r)
    top1, topk_value, k = _top_agreement(g, r, topk) if got.dtype.kind == "f" else (None,) * 3
    errors = []
    n_nan, n_ref_nan = int(g_nan.sum()), int(r_nan.sum())
    if np.any(g_nan & ~r_nan):
        errors.append(f"{int((g_nan & ~r_nan).sum())} NaN where the reference has a number")
    if not equal_nan and np.any(g_nan & r_nan):
        errors.append(f"{int((g_nan & r_nan).sum())} NaN in both engine and reference output")
    if min_cosine is not None and (cosine is None or cosine < min_cosine):
        errors.append(f"cosine similarity {cosine} below {min_cosine}")
    if min_top1 is not None and top1 is not None and top1 < min_top1:
        errors.append(f"top-1 agreement {top1:.4f} below {min_top1}")
    allclose = bool(within.all())
    return OutputCheck(
        name=name,
        passed=allclose and not errors,
        shape=tuple(ref.shape),
        allclose=allclose,
        max_abs=float(diff.max()),
        max_rel=float(rel.max()),
        mean_abs=float(diff.mean()),
        p50_abs=p50,
        p90_abs=p90,
        p99_abs=p99,
        mismatch=float(1.0 - within.mean()),
        cosine=cosine,
        top1=top1,
        topk=topk_value,
        k=k,
        nan=n_nan,
        ref_nan=n_ref_nan,
        worst=tuple(int(i) for i in worst),
        error="; ".join(errors) or None,
    )


def check_outputs(
    got: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    atol: float,
    rtol: float,
    **gates: Any,
) -> tuple[OutputCheck, ...]:
    """:func:`check_output` for every reference output, in the reference's order."""
    return tuple(check_output(n, got.get(n), r, atol, rtol, **gates) for n, r in ref.items())


def compare_outputs(
    got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], atol: float, rtol: float
) -> dict[str, dict[str, Any]]:
    """Per output: max abs error, max relative error, pass/fail at ``atol + rtol*|ref|``, and
    the rest of :class:`OutputCheck` as JSON.

    NaN where the reference has none (or a shape mismatch) is a failure, never a pass; NaN at
    the same place in both agrees here (a model may produce NaN on random inputs).
    """
    return {c.name: c.to_json() for c in check_outputs(got, ref, atol, rtol, equal_nan=True)}


def verification_points(
    model: Model, profiles: Sequence[Mapping[str, ShapeProfile]]
) -> list[dict[str, tuple[int, ...]]]:
    """Input shapes to verify at: min and max of every profile (batch 1 and 8 without profiles)."""
    points: list[dict[str, tuple[int, ...]]] = []
    candidates = (
        [concrete_shapes(model.inputs, p, point) for p in profiles for point in ("min", "max")]
        if profiles
        else [concrete_shapes(model.inputs, None, batch=b) for b in (1, 8)]
    )
    for shapes in candidates:
        if shapes not in points:
            points.append(shapes)
    return points


def verify_engine(engine: Engine, model: Model, config: BuildConfig) -> dict[str, Any]:
    """Run ``engine`` and the reference on random inputs at each verification point.

    Returns:
        ``{"passed", "atol", "rtol", "reference", "cases": [{"shapes", "outputs": {...}}]}``.
    """
    atol, rtol = config.tolerance
    session = reference_session(model)
    names = [o.name for o in model.outputs]
    cases: list[dict[str, Any]] = []
    for i, shapes in enumerate(verification_points(model, engine.profiles)):
        feeds = random_feeds(model.inputs, shapes, seed=config.seed + i)
        ref = dict(zip(names, session.run(names, feeds)))
        got = engine.infer(feeds)
        cases.append(
            {
                "shapes": {k: list(v) for k, v in shapes.items()},
                "outputs": compare_outputs(got, ref, atol, rtol),
            }
        )
    passed = all(o["passed"] for c in cases for o in c["outputs"].values())
    return {
        "passed": passed,
        "atol": atol,
        "rtol": rtol,
        "reference": "onnxruntime-cpu",
        "cases": cases,
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def summarize(report: Mapping[str, Any]) -> str:
    """One line per failing output, for error messages."""
    lines = []
    for case in report.get("cases", []):
        for name, o in case["outputs"].items():
            if not o["passed"]:
                detail = (
                    o.get("error")
                    or f"max abs error {_fmt(o.get('max_abs'))}, max rel {_fmt(o.get('max_rel'))}"
                )
                lines.append(f"output {name!r} at {case['shapes']}: {detail}")
    return "; ".join(lines)
