"""Numerical checks of an engine against a reference (ONNX Runtime CPU on the source model).

:func:`check_output` measures one output against its reference (max abs/rel error, the error
relative to the output's scale ``max|ref|``, error percentiles, cosine similarity, top-k
agreement for classifier-shaped outputs) and decides pass or fail by a rule:

- ``scaled`` (the default): ``max|engine - ref| <= atol + rtol * max|ref|`` and, for float
  outputs, cosine similarity >= ``min_cosine``; integer and boolean outputs must match exactly.
  Float32 reordering in a deep network leaves errors of ~1e-7..1e-5 of the output's range
  wherever an element happens to be near zero; this rule accepts them and still catches a
  weight changed by 1%.
- ``elementwise``: every element ``|engine - ref| <= atol + rtol * |ref|`` (numpy's allclose).

:func:`verify_engine` is the build-time check; :mod:`enginekit.evaluate.compare` runs the same
checks across backends. Why the defaults are what they are: docs/verification.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import BuildConfig, Precision, ShapeProfile, check_rule, default_tolerance
from enginekit.engine import Engine
from enginekit.errors import BuildError
from enginekit.feeds import make_feeds, model_name
from enginekit.model import Model, concrete_shapes, reference_session

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
        passed: within the rule's tolerance, no NaN the reference lacks, and the cosine /
            top-1 floors met.
        shape: the reference output's shape.
        allclose: every element within the rule's bound (the tolerance alone): ``atol + rtol *
            max|ref|`` (scaled) or ``atol + rtol * |ref|`` (elementwise).
        max_abs, max_rel, mean_abs: largest absolute and relative error, mean absolute error
            (``inf`` when an element is NaN on one side only).
        rule: the rule applied (``scaled`` or ``elementwise``).
        scale: the reference output's scale, ``max|ref|`` over its finite elements.
        scaled_error: ``max_abs / scale``: the largest error as a fraction of the output's
            scale (0 when both are 0, ``inf`` when only the scale is).
        bound: the scaled rule's limit on ``max_abs``, ``atol + rtol * scale``.
        p50_abs, p90_abs, p99_abs: percentiles of the absolute error.
        mismatch: fraction of elements outside the rule's bound.
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
    rule: str = "scaled"
    scale: float = 0.0
    scaled_error: float = 0.0
    bound: float | None = None
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
        out["rule"] = self.rule
        for key in ("max_abs", "max_rel", "mean_abs", "scale", "scaled_error", "bound"):
            out[key] = _num(getattr(self, key))
        for key in ("p50_abs", "p90_abs", "p99_abs"):
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
    rule: str = "scaled",
    equal_nan: bool = False,
    topk: int = DEFAULT_TOPK,
    min_cosine: float | None = None,
    min_top1: float | None = None,
) -> OutputCheck:
    """Compare one engine output with its reference.

    Args:
        name: the output's name (for the report).
        got, ref: engine and reference arrays; a missing ``got`` or a shape mismatch fails.
        atol, rtol: the tolerance: under ``rule="scaled"`` the output passes when
            ``max|got - ref| <= atol + rtol * max|ref|``; under ``"elementwise"`` when every
            element has ``|got - ref| <= atol + rtol * |ref|``.
        rule: ``scaled`` or ``elementwise``. Under ``scaled`` integer and boolean outputs
            must match exactly, and ``min_cosine`` is checked only when an error exceeds
            ``atol`` (an output of rounding noise has no direction to agree on).
        equal_nan: whether NaN in both at the same place agrees. NaN in the engine output where
            the reference has a number always fails; equal infinities always agree.
        topk: k of the top-k agreement for [batch, classes] outputs.
        min_cosine, min_top1: floors on cosine similarity (float outputs) and top-1 agreement.
    """
    check_rule(rule)
    ref = np.asarray(ref)
    if got is None:
        return OutputCheck(
            name, False, tuple(ref.shape), rule=rule, error="the engine returned no such output"
        )
    got = np.asarray(got)
    if got.shape != ref.shape:
        return OutputCheck(
            name,
            False,
            tuple(ref.shape),
            rule=rule,
            error=f"shape {got.shape} vs reference {ref.shape}",
        )
    if ref.size == 0:
        return OutputCheck(name, True, tuple(ref.shape), allclose=True, rule=rule)
    if ref.dtype.kind in "OUS" or got.dtype.kind in "OUS":  # strings: equal or not
        same = got.astype(str) == ref.astype(str)
        return OutputCheck(
            name,
            bool(same.all()),
            tuple(ref.shape),
            allclose=bool(same.all()),
            rule=rule,
            mismatch=float(1.0 - same.mean()),
            error=None if same.all() else f"{int((~same).sum())} strings differ",
        )
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    g_nan, r_nan = np.isnan(g), np.isnan(r)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.array(np.abs(g - r), dtype=np.float64)  # an array for 0-d outputs too
    diff[g == r] = 0.0  # equal infinities: inf - inf would be NaN
    diff[g_nan & r_nan] = 0.0 if equal_nan else np.inf
    diff[np.isnan(diff)] = np.inf  # NaN on one side only
    finite = np.isfinite(r)
    scale = float(np.abs(r[finite]).max()) if finite.any() else 0.0
    exact = ref.dtype.kind in "iub" and rule == "scaled"
    bound: float | None = None
    if rule == "scaled":
        bound = 0.0 if exact else atol + rtol * scale
        within = diff <= bound
    else:
        # An infinite reference would make the bound infinite and let any value through.
        within = diff <= np.where(finite, atol + rtol * np.abs(r), 0.0)
    max_abs = float(diff.max())
    with np.errstate(divide="ignore", invalid="ignore"):  # inf errors make inf/NaN, on purpose
        rel = diff / np.maximum(np.abs(r), np.finfo(np.float32).tiny)
        p50, p90, p99 = (float(v) for v in np.percentile(diff, [50, 90, 99], method="nearest"))
    scaled_error = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
    cosine = _cosine(g, r)
    is_float = got.dtype.kind in "fc" or ref.dtype.kind in "fc"
    top1, topk_value, k = _top_agreement(g, r, topk) if is_float else (None,) * 3
    errors = []
    n_nan, n_ref_nan = int(g_nan.sum()), int(r_nan.sum())
    if np.any(g_nan & ~r_nan):
        errors.append(f"{int((g_nan & ~r_nan).sum())} NaN where the reference has a number")
    if not equal_nan and np.any(g_nan & r_nan):
        errors.append(f"{int((g_nan & r_nan).sum())} NaN in both engine and reference output")
    cosine_gated = is_float and (rule == "elementwise" or max_abs > atol)
    if min_cosine is not None and cosine_gated and (cosine is None or cosine < min_cosine):
        errors.append(f"cosine similarity {_fmt(cosine, 7)} below {min_cosine}")
    if min_top1 is not None and top1 is not None and top1 < min_top1:
        errors.append(f"top-1 agreement {top1:.4f} below {min_top1}")
    allclose = bool(within.all())
    return OutputCheck(
        name=name,
        passed=allclose and not errors,
        shape=tuple(ref.shape),
        allclose=allclose,
        max_abs=max_abs,
        max_rel=float(rel.max()),
        mean_abs=float(diff.mean()),
        rule=rule,
        scale=scale,
        scaled_error=scaled_error,
        bound=bound,
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
    """:func:`check_output` for every reference output, in the reference's order, each at
    :func:`dtype_tolerance` for its reference's type."""
    out = []
    for name, r in ref.items():
        rule = gates.get("rule", "scaled")
        a, t, cos = dtype_tolerance(np.asarray(r).dtype, atol, rtol, rule, gates.get("min_cosine"))
        own = {**gates, "min_cosine": cos} if "min_cosine" in gates else gates
        out.append(check_output(name, got.get(name), r, a, t, **own))
    return tuple(out)


#: Output types narrower than float32, and the precision whose tolerance they are judged at.
_NARROW = {"float16": Precision.FP16, "bfloat16": Precision.BF16}


def dtype_tolerance(
    dtype: Any, atol: float, rtol: float, rule: str = "scaled", min_cosine: float | None = None
) -> tuple[float, float, float | None]:
    """(atol, rtol, min_cosine) for an output of ``dtype``.

    A float16 (bfloat16) output holds 11 (8) bits of mantissa: two correct engines that round
    one intermediate step differently already differ by one unit in the last place, ~5e-4
    (4e-3) of the output's scale, past float32's tolerance. Such outputs are judged at least
    as loosely as that type's precision (:func:`~enginekit.config.default_tolerance`);
    every other output, float32 included, keeps the tolerance given.
    """
    precision = _NARROW.get(np.dtype(dtype).name)
    if precision is None:
        return atol, rtol, min_cosine
    floor = default_tolerance(precision, rule)
    cos = min_cosine
    if cos is not None and floor.min_cosine is not None:
        cos = min(cos, floor.min_cosine)
    return max(atol, floor.atol), max(rtol, floor.rtol), cos


def compare_outputs(
    got: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    atol: float,
    rtol: float,
    rule: str = "scaled",
    min_cosine: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Per output: pass/fail under ``rule`` and every statistic of :class:`OutputCheck`, as JSON.

    NaN where the reference has none (or a shape mismatch) is a failure, never a pass; NaN at
    the same place in both agrees here (a model may produce NaN on random inputs).
    """
    checks = check_outputs(got, ref, atol, rtol, rule=rule, equal_nan=True, min_cosine=min_cosine)
    return {c.name: c.to_json() for c in checks}


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


def verify_engine(
    engine: Engine,
    model: Model,
    config: BuildConfig,
    data: Sequence[Mapping[str, np.ndarray]] | None = None,
    data_label: str = "verify_data",
) -> dict[str, Any]:
    """Run ``engine`` and the reference on the same inputs and judge every output.

    Args:
        engine, model: the engine and the reference model (run on ONNX Runtime CPU).
        config: the rule and tolerance (``config.verification``) and the seed.
        data: input sets to verify on; None: generated inputs at each verification point
            (:func:`enginekit.feeds.make_feeds`: valid values for integer shape/index inputs).
        data_label: what ``data`` is, for the report.

    Returns:
        ``{"passed", "rule", "atol", "rtol", "min_cosine", "reference", "data", "cases":
        [{"shapes", "outputs": {...}}], "worst": {output: the statistics of its worst case}}``.
    """
    tol = config.verification
    session = reference_session(model)
    names = [o.name for o in model.outputs]
    if data is None:
        sets = [
            make_feeds(model, shapes, seed=config.seed + i, session=session)
            for i, shapes in enumerate(verification_points(model, engine.profiles))
        ]
        label = "generated inputs at each profile's min and max"
    else:
        sets, label = [dict(d) for d in data], data_label
    cases: list[dict[str, Any]] = []
    for feeds in sets:
        try:
            ref = dict(zip(names, session.run(names, feeds)))
        except Exception as exc:  # the reference rejecting the inputs is the user's to fix
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
            raise BuildError(
                f"ONNX Runtime CPU (the reference) cannot run {model_name(model)} on the "
                f"{'verify_data' if data is not None else 'generated verification inputs'} "
                f"at {shapes}: {first}. Pass verify_data= (CLI: --verify-data) with inputs "
                "the model accepts"
            ) from None
        got = engine.infer(feeds)
        outputs = compare_outputs(got, ref, tol.atol, tol.rtol, tol.rule, tol.min_cosine)
        shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
        cases.append({"shapes": shapes, "outputs": outputs})
    passed = all(o["passed"] for c in cases for o in c["outputs"].values())
    return {
        "passed": passed,
        **tol.to_json(),
        "reference": "onnxruntime-cpu",
        "data": label,
        "cases": cases,
        "worst": worst_outputs(cases),
    }


def worst_outputs(cases: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per output, the statistics of the case where it did worst (failed, else largest
    scaled error), from a report's ``cases``."""

    def badness(o: Mapping[str, Any]) -> tuple[bool, float]:
        e = o.get("scaled_error")
        return (not o.get("passed"), math.inf if e is None else float(e))

    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        for name, o in case["outputs"].items():
            if name not in out or badness(o) > badness(out[name]):
                out[name] = dict(o)
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def summarize(report: Mapping[str, Any]) -> str:
    """One line per failing output, for error messages."""
    lines = []
    for case in report.get("cases", []):
        for name, o in case["outputs"].items():
            if not o["passed"]:
                detail = _error_text(o)
                if o.get("error"):
                    detail = f"{o['error']} ({detail})"
                lines.append(f"output {name!r} at {case['shapes']}: {detail}")
    return "; ".join(lines)


def _error_text(o: Mapping[str, Any]) -> str:
    if o.get("rule", "scaled") == "scaled":
        return (
            f"max abs error {_fmt(o.get('max_abs'))} = {_fmt(o.get('scaled_error'))} of the "
            f"output's scale max|ref| {_fmt(o.get('scale'))} (allowed {_fmt(o.get('bound'))}), "
            f"cosine {_fmt(o.get('cosine'), 7)}"
        )
    return (
        f"max abs error {_fmt(o.get('max_abs'))}, max rel {_fmt(o.get('max_rel'))}, "
        f"{_fmt(100 * o.get('mismatch', 0.0))}% of elements outside atol + rtol*|ref|"
    )
