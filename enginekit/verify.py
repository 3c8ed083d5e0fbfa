"""Numerical checks of an engine against a reference (ONNX Runtime CPU on the source model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import BuildConfig, ShapeProfile
from enginekit.engine import Engine
from enginekit.model import Model, concrete_shapes, random_feeds, reference_session


def compare_outputs(
    got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], atol: float, rtol: float
) -> dict[str, dict[str, Any]]:
    """Per output: max abs error, max relative error, and pass/fail at ``atol + rtol*|ref|``.

    NaN where the reference has none (or a shape mismatch) is a failure, never a pass.
    """
    report: dict[str, dict[str, Any]] = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            report[name] = {
                "passed": False,
                "error": f"shape {None if g is None else g.shape} vs reference {r.shape}",
            }
            continue
        g64, r64 = g.astype(np.float64), r.astype(np.float64)
        diff = np.abs(g64 - r64)
        both_nan = np.isnan(g64) & np.isnan(r64)
        diff = np.where(both_nan, 0.0, diff)
        nan_mismatch = bool(np.any(np.isnan(diff)))
        finite = np.where(np.isnan(diff), np.inf, diff)
        max_abs = float(finite.max()) if finite.size else 0.0
        rel = finite / np.maximum(np.abs(r64), np.finfo(np.float32).tiny)
        max_rel = float(rel.max()) if rel.size else 0.0
        ok = (not nan_mismatch) and bool(np.all(finite <= atol + rtol * np.abs(r64)))
        report[name] = {"max_abs": max_abs, "max_rel": max_rel, "passed": ok}
        if nan_mismatch:
            report[name]["error"] = "NaN where the reference has a number"
    return report


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


def summarize(report: Mapping[str, Any]) -> str:
    """One line per failing output, for error messages."""
    lines = []
    for case in report.get("cases", []):
        for name, o in case["outputs"].items():
            if not o["passed"]:
                detail = (
                    o.get("error")
                    or f"max abs error {o['max_abs']:.3g}, max rel {o['max_rel']:.3g}"
                )
                lines.append(f"output {name!r} at {case['shapes']}: {detail}")
    return "; ".join(lines)
