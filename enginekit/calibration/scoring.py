"""Scoring a quantized model against float32: errors, top-1 agreement, and how far that
agreement, measured on a finite number of rows, can be trusted.

The accuracy search (:mod:`enginekit.calibration.search`) accepts a plan on a *lower
confidence bound* of its agreement, not on the agreement it happened to read: on 150 held-out
rows a plan agreeing on 146 (97.3%) has about even odds of agreeing on less than 97% of new
data, and the search picks among dozens of such plans, which favours the lucky ones. The
one-sided Wilson bound at 80% confidence asks for 148 of 150 rows for a 97% target.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np


def measure(
    outputs: Sequence[Sequence[np.ndarray]], reference: Sequence[Sequence[np.ndarray]]
) -> dict[str, Any]:
    """Errors of ``outputs`` against ``reference`` (lists of per-batch output lists):
    max abs error, normalized MSE and, where outputs are ``[batch, classes]``, top-1
    agreement (the lowest over such outputs), with the number of rows and its 95% Wilson
    interval (``top1_interval``): on 150 rows 97% is [92.9%, 98.8%]."""
    max_abs, err, power, rows = 0.0, 0.0, 0.0, 0
    agree: list[float] = []
    for k in range(len(reference[0]) if reference else 0):
        got = np.concatenate([np.asarray(b[k], np.float64).reshape(len(b[k]), -1) for b in outputs])
        ref = np.concatenate(
            [np.asarray(b[k], np.float64).reshape(len(b[k]), -1) for b in reference]
        )
        diff = np.nan_to_num(np.abs(got - ref), nan=np.inf)
        max_abs = max(max_abs, float(diff.max()) if diff.size else 0.0)
        err += float((diff**2).sum())
        power += float((ref**2).sum())
        rows = max(rows, len(ref))
        if reference[0][k].ndim == 2 and reference[0][k].shape[1] >= 2:
            agree.append(float((got.argmax(1) == ref.argmax(1)).mean()))
    top1 = min(agree) if agree else None
    return {
        "top1_agreement": top1,
        "top1_interval": None if top1 is None else wilson(top1, rows),
        "rows": rows,
        "max_abs": max_abs,
        "nmse": err / power if power else err,
    }


def wilson(fraction: float, rows: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a fraction measured on ``rows`` rows: how far the
    agreement on other data of the same kind may plausibly lie from it."""
    if rows <= 0:
        return (0.0, 1.0)
    centre = (fraction + z * z / (2 * rows)) / (1 + z * z / rows)
    half = (
        z / (1 + z * z / rows) * np.sqrt(fraction * (1 - fraction) / rows + z * z / (4 * rows**2))
    )
    return (max(0.0, float(centre - half)), min(1.0, float(centre + half)))


def lower_bound(fraction: float, rows: int, confidence: float) -> float:
    """One-sided Wilson lower bound of a fraction measured on ``rows`` rows: the true fraction
    is at least this with probability ``confidence`` (0.5 gives the fraction itself)."""
    if rows <= 0:
        return 0.0
    if confidence <= 0.5:
        return float(fraction)
    z = statistics.NormalDist().inv_cdf(confidence)
    return wilson(fraction, rows, z)[0]


def rows_to_resolve(target: float, confidence: float) -> int:
    """Fewest rows on which all rows agreeing clears ``target`` at ``confidence`` (and, at
    0.5, on which the target allows at least one row to disagree)."""
    if confidence <= 0.5:
        return math.ceil(1 / (1 - target)) if target < 1 else 1
    if target >= 1:
        return 1 << 30
    rows = 1
    while lower_bound(1.0, rows, confidence) < target:
        rows *= 2
    low, high = rows // 2, rows
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if lower_bound(1.0, mid, confidence) < target else (low, mid)
    return high
