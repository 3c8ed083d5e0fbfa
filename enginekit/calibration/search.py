"""Accuracy-aware int8: the fastest Q/DQ plan that meets an accuracy target.

``enginekit.build(..., precision="int8", calib_data=..., accuracy_target=AccuracyTarget(
min_top1_agreement=0.97))`` runs :func:`search` instead of writing one Q/DQ model:

1. candidate bases: the Q/DQ model from the table's ranges under each calibration method the
   table can give (entropy, percentile, minmax: same histograms, no new pass over the data);
   each is measured, then the same with its weights re-rounded to keep each channel's sum
   (:mod:`enginekit.calibration.rounding`) or by GPTQ (:mod:`enginekit.calibration.gptq`,
   with calibration rows), then with its biases corrected (:mod:`enginekit.calibration.bias`);
   the base with the lowest output NMSE is kept (:func:`_rank`: agreement on the held-out
   rows is too coarse to rank bases);
2. sensitivity: each quantized layer is quantized *alone* (every other layer in float) and the
   output error it causes is measured on calibration (fitting) rows. Measured alone, a layer's
   own error shows even when many small errors add up (reverting one layer from a fully
   quantized model hides it under the others' errors);
3. plans: the ``k`` most sensitive layers kept in float, ``k`` = 0, 1, 2, 4, ... until the
   target holds, then bisected down to the smallest passing ``k``; fastest plan first, since
   every layer kept in float costs speed. Every plan tried is reported with its agreement,
   errors and speed.

Which rows feed what: everything that shapes a plan is fitted on the *calibration* rows
(``fit_rows``: the table's ranges, bias correction's channel means, the sensitivity ranking;
sum-preserving rounding uses no data); the *held-out* rows (``rows``) only score plans. Bias
correction fitted on the held-out rows it was then scored on measured the very rows it had
averaged over, flattering the reported agreement. Choosing among the scored plans is still
selection on the held-out rows (the search's purpose), so the agreement it reports is a
mildly optimistic estimate; the build's verification on ``verify_data``, or a benchmark's
separate test set, is the unbiased one. Without calibration rows (a table and
``verify_data``) bias correction is skipped and the sensitivity is measured on the scoring
rows; the manifest says which.

Plans are measured on ONNX Runtime CPU (the reference runtime every host has); the build
then verifies the chosen plan on its own backend against the same target. Layers kept in
float run in the backend's float precision; :func:`fallback_precision` says whether that can
be bf16 (a host with AVX512-BF16 or AMX and a backend that runs the float part of an int8
model in bf16: OpenVINO with its option ``int8_float_precision=bf16``, whose plan runner then
measures every plan in bf16) and why not. A bf16 float part first gets its f32 layers
(:mod:`enginekit.calibration.mixed`, chosen in ``plan.py`` before the search runs), and its
plans are timed against the float32 model (``float_runner``), not the bf16 one.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from enginekit import target as host_target
from enginekit.calibration.accuracy import ort_runner
from enginekit.calibration.bias import biases_from, correct_bias, correct_bias_sequential
from enginekit.calibration.cost import layer_macs, plan_cost
from enginekit.calibration.fallback import keep_float, quantized_nodes
from enginekit.calibration.gptq import gptq_round
from enginekit.calibration.rounding import preserve_sums
from enginekit.calibration.scoring import lower_bound, measure, rows_to_resolve
from enginekit.calibration.table import CalibrationTable
from enginekit.errors import BuildError, CalibrationError

log = logging.getLogger(__name__)

#: What layers kept out of int8 run in: ``float`` (the backend's float32), ``bf16`` (refused
#: where the host or backend cannot, or the backend's option does not ask for it), ``auto``
#: (bf16 where the host has it and the backend's option asks for it, else float).
FALLBACKS = ("auto", "float", "bf16")
#: Backends that run the float layers of an int8 model in bf16 when asked, and the backend
#: option that asks: OpenVINO 2026.4 compiles a Q/DQ model with the bf16 inference precision
#: hint into int8 kernels for the Q/DQ layers and bf16 ones for the rest (measured on a Zen 4
#: with AVX512-BF16, MobileNetV2 with 48 of 64 layers float: 1.9x faster than f32 there, top-1
#: agreement 89.0% vs 91.5%; docs/calibration.md). Opt-in: bf16 costs agreement, and fp32
#: MobileNetV2 run in bf16 agrees with fp32 on only 93.5%, below a 97% target.
BF16_FALLBACK_BACKENDS: dict[str, tuple[str, str]] = {
    "openvino": ("int8_float_precision", "bf16"),
}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: Rows the per-layer sensitivity runs on (each layer costs one run).
SENSITIVITY_ROWS = 32
TIMING_RUNS = 5
#: Shares of the sequentially corrected layers (upstream first) a ``+seqbiasNN`` base keeps
#: corrected; the whole correction is ``+seqbias``.
SEQUENTIAL_PARTS = (0.25, 0.5, 0.75)
#: The passing plans cheapest in float MACs that are timed against each other at the end,
#: the runs each gets, and how much faster (by the best run) another must be to beat the
#: cheapest.
FINAL_PLANS = 3
FINAL_RUNS = 10
FINAL_MARGIN = 0.05

Feeds = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class AccuracyTarget:
    """What an accuracy-aware int8 build must reach against the float32 model.

    Attributes:
        min_top1_agreement: lowest fraction (0 < t <= 1) of held-out rows whose top-1 class
            matches float32 (classifier-shaped outputs).
        max_abs_error: largest absolute output difference allowed.
        fallback: what layers kept out of int8 run in: ``auto``, ``float`` or ``bf16``
            (``bf16``: OpenVINO with its option ``int8_float_precision=bf16``, on a CPU with
            native bf16; ``auto`` follows that option).
        max_plans: most plans measured after the sensitivity pass.
        equalize: cross-layer equalization (:mod:`enginekit.passes.equalize`) of the float
            model before calibration (off by default: on MobileNetV2 with per-channel
            weights it measured +0-5 points of agreement and cost speed; docs/calibration.md).
        confidence: a plan meets ``min_top1_agreement`` when the one-sided Wilson lower bound
            of its held-out agreement at this confidence clears it (0.5: the agreement as
            read; :func:`~enginekit.calibration.scoring.lower_bound`). The default 0.8 asks
            for 148 of 150 rows for a 97% target: the plans are many, their agreements noisy,
            and the agreement as read let lucky plans through.
    """

    min_top1_agreement: float | None = None
    max_abs_error: float | None = None
    fallback: str = "auto"
    max_plans: int = 12
    equalize: bool = False
    confidence: float = 0.8

    def __post_init__(self) -> None:
        t, e = self.min_top1_agreement, self.max_abs_error
        if t is None and e is None:
            raise BuildError(
                "AccuracyTarget needs min_top1_agreement (e.g. 0.97) or max_abs_error (e.g. 0.5)"
            )
        if t is not None and not (isinstance(t, (int, float)) and 0.0 < t <= 1.0):
            raise BuildError(
                f"AccuracyTarget min_top1_agreement={t!r}: expected a fraction in (0, 1], e.g. 0.97"
            )
        if e is not None and not (isinstance(e, (int, float)) and e >= 0):
            raise BuildError(f"AccuracyTarget max_abs_error={e!r}: expected a number >= 0")
        if self.fallback not in FALLBACKS:
            close = difflib.get_close_matches(str(self.fallback), FALLBACKS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise BuildError(
                f"AccuracyTarget fallback={self.fallback!r}: expected one of "
                f"{', '.join(FALLBACKS)}{hint}"
            )
        if isinstance(self.max_plans, bool) or not isinstance(self.max_plans, int):
            raise BuildError(f"AccuracyTarget max_plans={self.max_plans!r}: expected an integer")
        if self.max_plans < 1:
            raise BuildError(f"AccuracyTarget max_plans={self.max_plans}: expected >= 1")
        c = self.confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.5 <= c < 1:
            raise BuildError(
                f"AccuracyTarget confidence={c!r}: expected a probability in [0.5, 1), e.g. 0.8 "
                "(0.5 accepts a plan on the agreement as measured)"
            )
        if not isinstance(self.equalize, bool):
            raise BuildError(f"AccuracyTarget equalize={self.equalize!r}: expected True or False")

    @classmethod
    def parse(cls, text: str) -> AccuracyTarget:
        """``top1=0.97``, ``max_abs=0.5``, a bare fraction (top-1 agreement), or several
        ``key=value`` joined by commas (``top1=0.97,fallback=float,cle=on``) — the CLI's
        form."""
        keys = {
            "top1": "min_top1_agreement", "max_abs": "max_abs_error", "fallback": "fallback",
            "cle": "equalize", "confidence": "confidence",
        }  # fmt: skip
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                key, value = "top1", key
            key = key.strip()
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise BuildError(
                    f"accuracy target {part!r}: key {key!r} is not one of "
                    f"{', '.join(keys)}{hint} (e.g. 'top1=0.97')"
                )
            if key == "fallback":
                values[keys[key]] = value.strip()
                continue
            if key == "cle":
                switch = {"on": True, "off": False, "true": True, "false": False}
                if value.strip().lower() not in switch:
                    raise BuildError(
                        f"accuracy target {part!r}: {value!r} is not on or off (e.g. 'cle=on')"
                    )
                values[keys[key]] = switch[value.strip().lower()]
                continue
            try:
                values[keys[key]] = float(value)
            except ValueError:
                raise BuildError(
                    f"accuracy target {part!r}: {value!r} is not a number (e.g. 'top1=0.97')"
                ) from None
        return cls(**values)

    def met(self, metrics: Mapping[str, Any]) -> bool:
        """Whether measured ``metrics`` (see :func:`measure`) meet this target: the top-1
        agreement's lower bound (:meth:`lower`) at least the target, or, on rows too few for
        any agreement to clear it at this confidence, every row agreeing."""
        t, e = self.min_top1_agreement, self.max_abs_error
        if t is not None:
            low = self.lower(metrics)
            rows = metrics.get("rows") or 0
            best = lower_bound(1.0, rows, self.confidence) if rows else 1.0
            if low is None or low < min(t, best) - 1e-12:
                return False
        return e is None or metrics["max_abs"] <= e

    def lower(self, metrics: Mapping[str, Any]) -> float | None:
        """The lower bound of the measured top-1 agreement at this target's confidence (the
        agreement itself where the row count is not known)."""
        agree = metrics.get("top1_agreement")
        if agree is None:
            return None
        rows = metrics.get("rows")
        return lower_bound(agree, rows, self.confidence) if rows else float(agree)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fallback_precision(
    target: AccuracyTarget,
    backend: str,
    flags: frozenset[str] | set[str] | None = None,
    options: Mapping[str, Any] | None = None,
) -> tuple[str, str]:
    """(``float`` or ``bf16``, why) for the layers kept out of int8: bf16 where the host has
    native bf16 and the backend's option (``BF16_FALLBACK_BACKENDS``) asks for it.

    Raises:
        BuildError: ``fallback="bf16"`` where the host or the backend cannot run it, or
            the backend option does not ask for it; ``fallback="float"`` where it does.
    """
    flags = host_target.cpu_flags() if flags is None else flags
    options = options or {}
    has = [f for f in _BF16_FLAGS if f in flags]
    switch = BF16_FALLBACK_BACKENDS.get(backend)
    asked = switch is not None and str(options.get(switch[0], "")).lower() == switch[1]
    if switch is not None and asked and target.fallback == "float":
        raise BuildError(
            f"accuracy target fallback='float' contradicts the {backend} option "
            f"{switch[0]}={switch[1]}: drop one of them"
        )
    if not has:
        why = f"this CPU has none of {', '.join(_BF16_FLAGS)} (no native bf16)"
    elif switch is None:
        why = f"backend {backend!r} runs the float layers of an int8 model in float32"
    elif not asked:
        why = (
            f"backend option {switch[0]} is not {switch[1]} (bf16 is opt-in: faster, less accurate)"
        )
    else:
        return "bf16", f"host has {', '.join(has)}; {backend} option {switch[0]}={switch[1]}"
    if target.fallback == "bf16":
        hint = (
            f" and set the {backend} option {switch[0]}={switch[1]}"
            if switch is not None and has and not asked
            else ""
        )
        raise BuildError(
            f"accuracy target fallback='bf16' refused: {why}. Use fallback='float' (or 'auto')"
            + (f", or keep fallback='bf16'{hint}" if hint else "")
        )
    return "float", why


# -- measuring ---------------------------------------------------------------------------------


#: Runs a model: proto -> (feeds -> outputs in graph order).
Runner = Callable[[onnx.ModelProto], Callable[[Feeds], Sequence[np.ndarray]]]


def _run(run: Callable[[Feeds], Sequence[np.ndarray]], rows: Sequence[Feeds]) -> list[Any]:
    return [list(run(feeds)) for feeds in rows]


def _paired_seconds(
    float_run: Callable[[Feeds], Any], run: Callable[[Feeds], Any], feeds: Feeds
) -> tuple[float, float]:
    """Median wall times of one run of the float model and of a plan on ``feeds``, the two
    alternating (after a warm-up run of each), so that a change in the machine's load or clock
    hits both alike: a float time taken once at the start made plans look up to 1.5x faster
    than the benchmark measured them."""
    float_run(feeds)
    run(feeds)
    times: list[list[float]] = [[], []]
    for _ in range(TIMING_RUNS):
        for side, call in enumerate((float_run, run)):
            start = time.perf_counter()
            call(feeds)
            times[side].append(time.perf_counter() - start)
    return float(np.median(times[0])), float(np.median(times[1]))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One measured plan: a base (calibration method) and the layers kept in float."""

    method: str
    kept: tuple[str, ...]
    metrics: Mapping[str, Any]
    seconds: float
    met: bool
    float_seconds: float  # the float model, timed alternately with this plan
    float_share: float = 0.0  # share of the quantized layers' MACs run in float (cost.py)
    final_speedup: float | None = None  # vs fp32 in the final timing (_final_timing), if timed

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "float_layers": len(self.kept),
            "float_macs_share": self.float_share,
            "top1_agreement": self.metrics["top1_agreement"],
            "top1_interval": self.metrics.get("top1_interval"),
            "top1_lower_bound": self.metrics.get("top1_lower_bound"),
            "rows": self.metrics.get("rows"),
            "max_abs": self.metrics["max_abs"],
            "nmse": self.metrics["nmse"],
            "seconds": self.seconds,
            "float_seconds": self.float_seconds,
            "speedup_vs_fp32": self.float_seconds / self.seconds if self.seconds else None,
            "final_speedup_vs_fp32": self.final_speedup,
            "met": self.met,
        }


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The chosen Q/DQ model and what the search measured (for the manifest)."""

    model: onnx.ModelProto
    chosen: Plan
    plans: tuple[Plan, ...]
    sensitivity: tuple[tuple[str, float], ...]
    float_seconds: float
    fallback: str
    fallback_reason: str
    rows: int
    runs_on: str = "ONNX Runtime CPU"
    fit_rows: int = 0  # calibration rows the fitted steps used (0: none given)
    speed_vs: str = "ONNX Runtime CPU float32"  # what speedup_vs_fp32 is relative to
    # The bf16 float part's manifest entry (``mixed.FloatPart.manifest_entry``; a mapping, so
    # that this module need not import ``mixed``, which imports its types from here).
    float_part: Mapping[str, Any] | None = None

    def manifest_entry(self, target: AccuracyTarget) -> dict[str, Any]:
        """What the manifest records: the target, every plan tried, the layers kept in float
        and why (each one's error when quantized alone, and its rank)."""
        rank = {name: i for i, (name, _) in enumerate(self.sensitivity)}
        error = dict(self.sensitivity)
        return {
            "target": target.to_json(),
            "measured_on": f"{self.runs_on}, {self.rows} held-out rows",
            "criterion": criterion(target),
            "fitted_on": (
                f"{self.fit_rows} calibration rows (bias correction, sensitivity), none of "
                "them held out"
                if self.fit_rows
                else "no calibration rows: bias correction skipped, sensitivity measured on "
                "the held-out rows"
            ),
            "chosen": self.chosen.to_json(),
            "float_seconds": self.float_seconds,
            "speed_vs": self.speed_vs,
            "fallback_precision": self.fallback,
            "fallback_reason": self.fallback_reason,
            "float_part": (
                dict(self.float_part)
                if self.float_part is not None
                else {"precision": self.fallback, "reason": self.fallback_reason}
            ),
            "kept_in_float": [
                {
                    "layer": name,
                    "why": (
                        f"sensitivity rank {rank[name] + 1} of {len(rank)}: quantized alone it "
                        f"gives an output NMSE of {error[name]:.3g}"
                    ),
                }
                for name in self.chosen.kept
            ],
            "plans": [p.to_json() for p in self.plans],
        }


def criterion(target: AccuracyTarget) -> str:
    """When a plan meets ``target``, in words (for the manifest and the CLI)."""
    parts = []
    t = target.min_top1_agreement
    if t is not None:
        if target.confidence > 0.5:
            parts.append(
                f"the one-sided {target.confidence:.0%} Wilson lower bound of the held-out "
                f"top-1 agreement >= {t:g} (every row agreeing where the rows are too few)"
            )
        else:
            parts.append(f"held-out top-1 agreement >= {t:g}")
    if target.max_abs_error is not None:
        parts.append(f"max abs error <= {target.max_abs_error:g}")
    return " and ".join(parts)


def search(
    source: onnx.ModelProto,
    table: CalibrationTable,
    rows: Sequence[Feeds],
    target: AccuracyTarget,
    write: Callable[[CalibrationTable], onnx.ModelProto],
    fallback: tuple[str, str] = ("float", "float32"),
    runner: Runner | None = None,
    runs_on: str = "ONNX Runtime CPU",
    fit_rows: Sequence[Feeds] = (),
    float_runner: Runner | None = None,
    speed_vs: str = "",
    float_part: Mapping[str, Any] | None = None,
) -> SearchResult:
    """The fastest plan meeting ``target`` on ``rows`` (held-out batches), see module doc.

    Args:
        source: the float model.
        table: its calibration table.
        rows: held-out batches (never seen by calibration): plans are scored on them only.
        target: what to reach.
        write: table -> Q/DQ model (:func:`~enginekit.calibration.writers.write_qdq` with the
            backend's options).
        fallback: (precision, why) of the layers kept in float, for the report.
        runner: what measures plans (default: ONNX Runtime CPU); a backend whose int8
            kernels round differently (OpenVINO) passes its own; ``runs_on`` names it.
        fit_rows: calibration batches, disjoint from ``rows``, that bias correction and the
            sensitivity ranking are fitted on (without them: no bias correction, and the
            sensitivity is measured on ``rows``).
        float_runner: what runs the float32 model every plan is timed against (default:
            ``runner``; a runner whose float part is bf16 passes its float32 twin, so that
            "x fp32" means fp32); ``speed_vs`` names it.
        float_part: the bf16 float part's manifest entry (:mod:`.mixed`).

    Raises:
        CalibrationError: no held-out rows.
    """
    if not rows:
        raise CalibrationError(
            "accuracy_target needs held-out data to measure plans on: pass calib_data= (every "
            "10th sample is held out) or verify_data=; a calibration table alone has no rows"
        )
    count = sum(_rows(f) for f in rows)
    if target.min_top1_agreement is not None and count * (1 - target.min_top1_agreement) < 1:
        log.warning(
            "accuracy target top1=%s on %d held-out rows allows no row to disagree: the plan "
            "chosen may agree less on other data; it needs at least %d rows (give more "
            "calib_data, or verify_data=)",
            target.min_top1_agreement, count, _resolving(target),
        )  # fmt: skip
    if target.min_top1_agreement is not None and target.confidence > 0.5:
        needed = rows_to_resolve(target.min_top1_agreement, target.confidence)
        if count < needed:
            log.warning(
                "accuracy target top1=%s at confidence %s needs %d held-out rows (all of them "
                "agreeing); on %d only a plan on which every row agrees is accepted",
                target.min_top1_agreement, target.confidence, needed, count,
            )  # fmt: skip
    runner = runner or ort_runner
    # The reference is the float model on ONNX Runtime, as in every int8 verification.
    reference = _run(ort_runner(source), rows)
    timing = rows[0]
    float_run = (float_runner or runner)(source)
    plans: list[Plan] = []
    costs: dict[str, float] = {}  # MACs of each quantized layer, once the base is chosen

    tried: dict[tuple[str, frozenset[str]], Plan] = {}

    def evaluate(method: str, proto: onnx.ModelProto, kept: Sequence[str]) -> Plan:
        key = (method, frozenset(kept))
        if key in tried:  # the two orders share their first layers: measured once
            return tried[key]
        run = runner(proto)
        metrics = measure(_run(run, rows), reference)
        metrics["top1_lower_bound"] = target.lower(metrics)
        fp32, seconds = _paired_seconds(float_run, run, timing)
        share = plan_cost(costs, kept)
        plan = Plan(method, tuple(kept), metrics, seconds, target.met(metrics), fp32, share)
        plans.append(plan)
        tried[key] = plan
        log.info(
            "plan %s, %d layers in float: %s, %.2fx fp32",
            method, len(kept), metrics, fp32 / seconds,
        )  # fmt: skip
        return plan

    bases: dict[str, onnx.ModelProto] = {}
    for method in _methods(table):
        bases[method] = write(table if method == table.method else table.with_method(method))
        evaluate(method, bases[method], ())
    best = max(plans, key=_rank)
    if not best.met:
        # Sum-preserving rounding and bias correction of every base, so that the layers kept
        # in float are chosen from the most accurate all-int8 plan: which method is best
        # can change with them. Bias correction is tried on both roundings (with 7-bit weights
        # re-rounding alone measured worse on MobileNetV2, and better with bias).
        # GPTQ rounding (fitted on the calibration rows; its second moments depend on the
        # float model only, so they are taken once for every base).
        moments: dict[str, np.ndarray] = {}
        for start in list(bases):
            variants = [start]
            rounded, changed = preserve_sums(bases[start], source)
            if changed:
                variants.append(f"{start}+sums")
                bases[variants[-1]] = rounded
                best = max((best, evaluate(variants[-1], rounded, ())), key=_rank)
            if fit_rows and not best.met:
                rounded, changed = gptq_round(bases[start], source, fit_rows, moments)
                if changed:
                    variants.append(f"{start}+gptq")
                    bases[variants[-1]] = rounded
                    best = max((best, evaluate(variants[-1], rounded, ())), key=_rank)
            for variant in variants:
                if best.met or not fit_rows:
                    break
                corrected, fixed = correct_bias(bases[variant], source, fit_rows)
                if fixed:
                    label = f"{variant}+bias"
                    bases[label] = corrected
                    best = max((best, evaluate(label, corrected, ())), key=_rank)
            if best.met:
                break
        if fit_rows and not best.met:
            # Sequential bias correction of the best base only (one run of the Q/DQ model per
            # level of layers, ~40 s on EfficientNet-Lite0): the mean shifts the quantized
            # activations cause as well, measured inside the Q/DQ model. Ranked like every
            # base (EfficientNet-Lite0 NMSE 0.0087 -> 0.0064; MobileNetV2 worse, left out).
            start = best.method
            corrected, fixed = correct_bias_sequential(bases[start], source, fit_rows)
            if fixed:
                label = f"{start}+seqbias"
                bases[label] = corrected
                best = max((best, evaluate(label, corrected, ())), key=_rank)
                # The correction stopped after the first levels (its layers come level by
                # level): on MobileNetV2 the late layers' corrections cost what the early
                # ones gain (NMSE 0.0133 -> 0.096 in all, 0.0115 for the first half).
                for part in SEQUENTIAL_PARTS:
                    first = round(len(fixed) * part)
                    if 0 < first < len(fixed):
                        label = f"{start}+seqbias{round(part * 100)}"
                        bases[label] = biases_from(corrected, bases[start], fixed[:first])
                        best = max((best, evaluate(label, bases[label], ())), key=_rank)
    base, method = bases[best.method], best.method
    layers = quantized_nodes(base)
    sensitivity: list[tuple[str, float]] = []
    chosen = best if best.met else None
    if chosen is None and layers:
        sensitivity = _sensitivity(source, base, layers, fit_rows or rows, runner)
        costs.update(layer_macs(source, layers))
        for order in _orders(sensitivity, costs):
            found = _fallback_search(source, base, method, order, target, evaluate)
            chosen = chosen or found
    if chosen is None:  # nothing to keep in float: report the best measured
        chosen = best
    # The fastest plan meeting the target: the least arithmetic in float (where the float
    # layers are matters more than how many, see cost.py; timings of plans differ by noise on
    # a loaded machine, MACs do not), then the fewest layers, then the most accurate.
    by_cost = sorted(
        (p for p in plans if p.met),
        key=lambda p: (round(p.float_share, 9), len(p.kept), -_score(p)[0], -_score(p)[1]),
    )
    fastest = by_cost[0] if by_cost else chosen

    def proto(p: Plan) -> onnx.ModelProto:
        return bases[p.method] if not p.kept else keep_float(base, source, p.kept)

    if len(by_cost) > 1:
        # The cheapest passing plans timed once more, against each other (MACs do not count
        # the reorders at float/int8 boundaries, nor layers whose int8 kernel gains little).
        final = [(p, proto(p)) for p in by_cost[:FINAL_PLANS]]
        timed = _final_timing(float_run, runner, final, timing)
        plans = [timed.get(id(p), p) for p in plans]
        fastest = _measured_fastest([timed[id(p)] for p in by_cost[:FINAL_PLANS]])
    model = proto(fastest)
    float_seconds = float(np.median([p.float_seconds for p in plans]))
    return SearchResult(
        model, fastest, tuple(plans), tuple(sensitivity), float_seconds, *fallback,
        count, runs_on, sum(_rows(f) for f in fit_rows), speed_vs or f"{runs_on} float32",
        float_part,
    )  # fmt: skip


def _final_timing(
    float_run: Callable[[Feeds], Any],
    runner: Runner,
    candidates: Sequence[tuple[Plan, onnx.ModelProto]],
    feeds: Feeds,
) -> dict[int, Plan]:
    """Each candidate plan (keyed by ``id`` of the plan given) with ``final_speedup``: the
    float model's best time over the plan's best time, the float model and every candidate
    running in turn ``FINAL_RUNS`` times (after a warm-up). The best of several runs, not
    their median: on a loaded machine the load only ever adds time."""
    runs = [float_run] + [runner(model) for _, model in candidates]
    best = [np.inf] * len(runs)
    for run in runs:
        run(feeds)
    for _ in range(FINAL_RUNS):
        for k, run in enumerate(runs):
            start = time.perf_counter()
            run(feeds)
            best[k] = min(best[k], time.perf_counter() - start)
    return {
        id(plan): dataclasses.replace(plan, final_speedup=best[0] / best[k + 1])
        for k, (plan, _) in enumerate(candidates)
    }


def _measured_fastest(candidates: Sequence[Plan]) -> Plan:
    """The first of ``candidates`` (cheapest in float MACs) unless another measured at least
    ``FINAL_MARGIN`` faster in the final timing (a smaller gap is within its noise)."""
    first = candidates[0]
    best = max(candidates, key=lambda p: p.final_speedup or 0.0)
    if (best.final_speedup or 0.0) >= (first.final_speedup or 0.0) * (1 + FINAL_MARGIN):
        return best
    return first


def _methods(table: CalibrationTable) -> list[str]:
    """The table's method first, then the others its histograms can give."""
    if any(r.histogram is None for r in table.tensors.values()):
        return [table.method]
    return [table.method, *(m for m in ("percentile", "entropy", "minmax") if m != table.method)]


def _resolving(target: AccuracyTarget) -> int:
    """Fewest rows on which the top-1 target allows at least one disagreeing row."""
    t = target.min_top1_agreement or 0.0
    return int(np.ceil(1 / (1 - t))) if t < 1 else 1


def _rank(plan: Plan) -> tuple[bool, float, float, float]:
    """Which all-int8 base the layers kept in float are chosen from: one meeting the target,
    then the lowest output NMSE, then the highest agreement, then the fastest. NMSE before
    agreement: on 150 held-out rows one row is 0.7 points, and MobileNetV2's bases read
    86.7% (NMSE 0.0154, no GPTQ) vs 82.7% (0.0137, GPTQ) held out, but 85% vs 88% on 200 test
    crops, in the NMSE's order; the plans that then meet a 97% target sit near NMSE 2e-4."""
    agree, error = _score(plan)
    return plan.met, error, agree, -plan.seconds


def _score(plan: Plan) -> tuple[float, float]:
    agree = plan.metrics["top1_agreement"]
    return (agree if agree is not None else 0.0, -plan.metrics["nmse"])


def _rows(feeds: Feeds) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


def _sensitivity(
    source: onnx.ModelProto,
    base: onnx.ModelProto,
    layers: Sequence[str],
    rows: Sequence[Feeds],
    runner: Runner,
) -> list[tuple[str, float]]:
    """Each layer's output NMSE when it alone is quantized, most sensitive first."""

    def alone(name: str) -> Callable[[Feeds], Sequence[np.ndarray]]:
        return runner(keep_float(base, source, [n for n in layers if n != name]))

    return rank_alone(source, layers, rows, alone)[0]


def rank_alone(
    source: onnx.ModelProto,
    layers: Sequence[str],
    rows: Sequence[Feeds],
    alone: Callable[[str], Callable[[Feeds], Sequence[Any]]],
) -> tuple[list[tuple[str, float]], int]:
    """Each layer's output NMSE against ``source`` on ONNX Runtime when ``alone(layer)`` (a
    runner of the model with that layer alone changed: quantized, or in bf16) runs, measured
    on the first whole batches of ``rows`` up to :data:`SENSITIVITY_ROWS`; most sensitive
    first, and the rows measured."""
    sample, count = [], 0
    for feeds in rows:  # whole batches (a fixed-batch model takes no other size)
        if count >= SENSITIVITY_ROWS:
            break
        sample.append(feeds)
        count += _rows(feeds)
    reference = _run(ort_runner(source), sample)
    out = [(name, measure(_run(alone(name), sample), reference)["nmse"]) for name in layers]
    return sorted(out, key=lambda item: -item[1]), count


def _orders(
    sensitivity: Sequence[tuple[str, float]], costs: Mapping[str, float]
) -> list[list[str]]:
    """The orders in which layers are kept in float: most sensitive first, and most
    sensitive per MAC first (a cheap late layer before a costly early one of the same error),
    the second only where it differs."""
    by_error = [n for n, _ in sensitivity]
    floor = max(sum(costs.values()), 1.0) * 1e-6  # a layer of no MACs still costs something
    ratio = {n: error / max(costs.get(n, 0.0), floor) for n, error in sensitivity}
    by_ratio = sorted(by_error, key=lambda n: -ratio[n])
    return [by_error] if by_ratio == by_error else [by_error, by_ratio]


def _fallback_search(
    source: onnx.ModelProto,
    base: onnx.ModelProto,
    method: str,
    order: Sequence[str],
    target: AccuracyTarget,
    evaluate: Callable[[str, onnx.ModelProto, Sequence[str]], Plan],
) -> Plan | None:
    """Keep the ``k`` most sensitive layers in float, ``k`` doubling until the target holds,
    then bisect down to the smallest passing ``k`` (within ``target.max_plans``).

    Every layer in float is the float model itself, which any target allows: it bounds the
    bisection without being measured, and is measured only when no smaller plan meets the
    target (it was one of ~40 plans measured on MobileNetV2, each order's, for nothing)."""
    budget = target.max_plans
    fail, passed = 0, None
    n = len(order)
    k = 1
    while budget and k < n:
        plan = evaluate(method, keep_float(base, source, order[:k]), order[:k])
        budget -= 1
        if plan.met:
            passed = plan
            break
        fail = k
        k = min(2 * k, n)
    hi = len(passed.kept) if passed is not None else n
    while budget and hi - fail > 1:
        mid = (fail + hi) // 2
        plan = evaluate(method, keep_float(base, source, order[:mid]), order[:mid])
        budget -= 1
        if plan.met:
            passed, hi = plan, mid
        else:
            fail = mid
    if passed is None and budget and fail == n - 1:  # nothing short of all float met it
        plan = evaluate(method, keep_float(base, source, order), order)
        passed = plan if plan.met else None
    return passed
