"""What ``enginekit.build`` does for reduced precision: pick or make the calibration table,
write the Q/DQ model the backend builds from, and verify the engine on real data.

Backend convention (no registry change needed):

- ``PRECISIONS``: a backend module may list the precisions it builds, e.g.
  ``PRECISIONS = ("fp32", "fp16", "bf16", "int8")``; ``build`` refuses others, and
  ``enginekit backends`` shows the list. A backend without it is trusted to check itself.
- For ``int8`` a backend receives the Q/DQ model (``config.precision`` is int8), never the
  table. It may define ``qdq_options(config) -> dict`` returning keyword arguments for
  :func:`enginekit.calibration.writers.write_qdq` (style, per_channel, reduce_range); without
  it the portable ``tensorrt`` style is used. A model that already carries Q/DQ nodes
  (quantization-aware training) is handed over as it is.
- fp16/bf16 models are the backend's to make (``enginekit.calibration.convert`` has both).
- With an accuracy target (:mod:`enginekit.calibration.search`) the plans are measured on
  ONNX Runtime CPU, unless the backend defines ``plan_runner(config) -> Runner`` (a function
  from a Q/DQ ModelProto to a callable running feeds): then on its own int8 kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from enginekit.calibration import run as run_calibration
from enginekit.calibration.accuracy import Gates, accuracy_report, summarize
from enginekit.calibration.collect import has_qdq
from enginekit.calibration.data import DEFAULT_BATCH, Holdout, batches
from enginekit.calibration.mixed import F32_OPTIONS, FloatPart, choose_f32_layers
from enginekit.calibration.search import (
    BF16_FALLBACK_BACKENDS,
    AccuracyTarget,
    fallback_precision,
    search,
)
from enginekit.calibration.table import CalibrationTable, as_table
from enginekit.calibration.writers import write_qdq
from enginekit.config import BuildConfig, Precision
from enginekit.engine import Engine
from enginekit.errors import BuildError, CalibrationError
from enginekit.feeds import make_feeds
from enginekit.model import Model, load_model
from enginekit.progress import step
from enginekit.verify import verification_points

log = logging.getLogger(__name__)

#: Samples held out of ``calib_data`` for verification: every 10th, at most 512.
HOLDOUT_EVERY = 10
HOLDOUT_CAP = 512
#: With an accuracy target, at least this many samples are held out (every 2nd of the first
#: ``2 * n``, then every 10th): plans are chosen on them, and 30 rows (every 10th of 300)
#: cannot tell 97% from 100%.
SEARCH_MIN_ROWS = 150
#: With an accuracy target, this many calibration (fitting) samples are also kept: bias
#: correction and the sensitivity ranking are fitted on them, the held-out rows only score.
SEARCH_FIT_ROWS = 256
VERIFY_CAP = 1024


@dataclasses.dataclass(frozen=True)
class Quantization:
    """The reduced-precision arguments of ``build`` (all optional).

    Attributes:
        calibration: a CalibrationTable or the path of its JSON.
        calib_data: calibration data to calibrate on the fly (any source ``calibrate`` takes);
            every 10th sample is held out for verification (with ``target``, every 2nd of the
            first 300, then every 10th: at least 150 rows to choose a plan on).
        calib_method: method for ``calib_data``: entropy, percentile or minmax.
        verify_data: data to verify on (instead of the held-out samples).
        gates: accuracy gates checked on the verification data.
        allow_table_mismatch: accept a table made for another model hash.
        target: accuracy-aware int8: the fastest plan (layers kept in float) meeting it
            (:mod:`enginekit.calibration.search`); its limits are also the gates.
    """

    calibration: CalibrationTable | str | os.PathLike | None = None
    calib_data: Any = None
    calib_method: str = "entropy"
    verify_data: Any = None
    gates: Gates = dataclasses.field(default_factory=Gates)
    allow_table_mismatch: bool = False
    target: AccuracyTarget | None = None

    @property
    def checked_gates(self) -> Gates:
        """The gates verification applies: the target's limits where no gate is given."""
        t, g = self.target, self.gates
        if t is None:
            return g
        return Gates(
            g.min_top1_agreement if g.min_top1_agreement is not None else t.min_top1_agreement,
            g.max_abs_error if g.max_abs_error is not None else t.max_abs_error,
        )


@dataclasses.dataclass(frozen=True)
class Quantized:
    """The model the backend builds from, and what the manifest records about it."""

    model: Model
    table: CalibrationTable | None = None
    held_out: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    entry: dict[str, Any] | None = None
    #: Backend options the search chose (the bf16 float part's f32 layers), added to the
    #: build's config so that the backend builds the plan that was measured.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def table_hash(self) -> str | None:
        return self.table.sha256 if self.table is not None else None


def check_precision(backend: Any, config: BuildConfig) -> None:
    """Refuse a precision the backend does not list in ``PRECISIONS`` (if it has the list)."""
    listed = getattr(backend, "PRECISIONS", None)
    if listed is not None and config.precision.value not in listed:
        raise BuildError(
            f"backend {config.backend!r} builds precisions {', '.join(listed)}, not "
            f"{config.precision.value}"
        )


def quantize(model: Model, config: BuildConfig, backend: Any, q: Quantization) -> Quantized:
    """The model to hand the backend: the source, or for int8 its Q/DQ version.

    Raises:
        BuildError: int8 without a table or data; both given; data or table arguments given
            for a precision that takes none.
        CalibrationError: bad data, or a table for another model.
    """
    if config.precision != Precision.INT8:
        given = [
            name
            for name, value in (
                ("calibration", q.calibration), ("calib_data", q.calib_data),
                ("min_top1_agreement", q.gates.min_top1_agreement),
                ("max_abs_error", q.gates.max_abs_error),
                ("accuracy_target", q.target),
            )
            if value is not None
        ]  # fmt: skip
        if given:
            raise BuildError(
                f"{', '.join(given)}: for precision='int8'; this build is "
                f"{config.precision.value}, verified against ONNX Runtime CPU at a tolerance (atol=, "
                "rtol=, min_cosine=; docs/verification.md)"
            )
        return Quantized(model)
    if q.calibration is not None and q.calib_data is not None:
        raise BuildError("give calibration= (a table) or calib_data= (data), not both")
    if has_qdq(model.proto):
        if q.calibration is not None or q.calib_data is not None:
            log.warning("the model already carries Q/DQ nodes; its own scales are used")
        return Quantized(model, entry={"source": "model (Q/DQ nodes already present)"})
    searching = q.target is not None
    held = Holdout(
        HOLDOUT_EVERY, HOLDOUT_CAP, SEARCH_MIN_ROWS if searching else 0,
        SEARCH_FIT_ROWS if searching else 0,
    )  # fmt: skip
    equalized: dict[str, Any] | None = None
    if q.target is not None and q.target.equalize:
        model, equalized = _equalize(model, q)
    if q.calibration is not None:
        table = as_table(q.calibration)
    elif q.calib_data is not None:
        table = run_calibration(
            model, q.calib_data, q.calib_method, profile=_profile(config), holdout=held
        )
    else:
        raise BuildError(
            "precision='int8' needs calibration: pass calibration=<table or calib.json> "
            "(enginekit calibrate makes one) or calib_data=<representative inputs>; a model "
            "with Q/DQ nodes (quantization-aware training) needs neither"
        )
    table.check_model(model.sha256, q.allow_table_mismatch)
    hook = getattr(backend, "qdq_options", None)
    options = dict(hook(config)) if hook is not None else {}
    entry = {**table.manifest_entry(), "qdq": {"style": "tensorrt", **options}}
    if equalized is not None:
        entry["equalization"] = equalized
    if q.target is not None:
        return _search(model, config, backend, table, held, q, q.target, options, entry)
    with step("writing the Q/DQ model"):
        qdq = write_qdq(model, table, allow_table_mismatch=q.allow_table_mismatch, **options)
    return Quantized(load_model(qdq), table, held.held, entry)


def _equalize(model: Model, q: Quantization) -> tuple[Model, dict[str, Any]]:
    """The model cross-layer equalized (same float outputs) and what was done, for the
    manifest. A table given as ``calibration=`` was made for the unequalized model: refused."""
    if q.calibration is not None:
        raise BuildError(
            "accuracy target cle=on equalizes the model before calibration, so a table made "
            "for the original model does not fit it: pass calib_data= instead of calibration="
        )
    from enginekit.passes.equalize import equalize

    with step("cross-layer equalization"):
        proto, info = equalize(model.proto)
    return load_model(proto), info.to_json()


def _search(
    model: Model,
    config: BuildConfig,
    backend: Any,
    table: CalibrationTable,
    holdout: Holdout,
    q: Quantization,
    target: AccuracyTarget,
    options: Mapping[str, Any],
    entry: dict[str, Any],
) -> Quantized:
    """Accuracy-aware int8: the fastest plan meeting ``target`` on held-out rows (or
    ``verify_data``), recorded in the manifest's ``calibration.accuracy_search``. What the
    search fits (bias correction, the sensitivity ranking) comes from the calibration rows
    ``holdout`` kept, never from the rows it scores on."""
    fallback = fallback_precision(target, config.backend, options=config.options)
    held = holdout.held
    rows: list[dict[str, np.ndarray]] = list(held)
    if not rows and q.verify_data is not None:
        rows = verify_batches(q.verify_data, model, config) or []
    if not rows:
        raise CalibrationError(
            "accuracy_target needs held-out rows to measure plans on: pass calib_data= (every "
            f"{HOLDOUT_EVERY}th sample is held out; give at least {HOLDOUT_EVERY}) or "
            "verify_data=; a calibration table alone has none"
        )
    # Batches as the model takes them (a fixed-batch model's held-out rows are re-cut).
    rows = list(batches(rows, model.inputs, DEFAULT_BATCH, None, _profile(config)))
    fit = list(batches(holdout.fitted, model.inputs, DEFAULT_BATCH, None, _profile(config)))

    def write(t: CalibrationTable) -> Any:
        return write_qdq(model, t, allow_table_mismatch=q.allow_table_mismatch, **options)

    # A backend whose int8 kernels round differently from ONNX Runtime's measures the plans
    # itself: ``plan_runner(config) -> Runner`` (see enginekit.calibration.search).
    hook = getattr(backend, "plan_runner", None)
    runner = hook(config) if hook is not None else None
    runs_on = f"{config.backend} CPU" if hook is not None else "ONNX Runtime CPU"
    part, chosen, float_runner, speed_vs = _float_part(
        model, config, hook, fallback, rows, fit, target
    )
    if part is not None and part.f32_layers and hook is not None:
        runner = hook(_with_options(config, {F32_OPTIONS[config.backend]: list(part.f32_layers)}))
    with step(f"searching int8 plans for {target}"):
        result = search(
            model.proto, table, rows, target, write, fallback, runner, runs_on, fit_rows=fit,
            float_runner=float_runner, speed_vs=speed_vs,
            float_part=part.manifest_entry() if part is not None else None,
        )  # fmt: skip
    entry = {**entry, "accuracy_search": result.manifest_entry(target)}
    method, *steps = result.chosen.method.split("+")
    entry["method"] = method
    entry["sum_preserving_rounding"] = "sums" in steps
    entry["gptq_rounding"] = "gptq" in steps
    entry["bias_correction"] = "bias" in steps
    seq = next((s for s in steps if s.startswith("seqbias")), None)
    entry["sequential_bias_correction"] = seq is not None
    if seq is not None:  # ``seqbias50``: the first 50% of its layers (upstream first)
        entry["sequential_bias_share"] = int(seq[len("seqbias") :] or 100) / 100
    return Quantized(load_model(result.model), table, held, entry, chosen)


def _float_part(
    model: Model,
    config: BuildConfig,
    hook: Any,
    fallback: tuple[str, str],
    rows: list[dict[str, np.ndarray]],
    fit: list[dict[str, np.ndarray]],
    target: AccuracyTarget,
) -> tuple[FloatPart | None, dict[str, Any], Any, str]:
    """The bf16 float part's f32 layers (:mod:`enginekit.calibration.mixed`), the backend
    options that build them, what runs the float32 model plans are timed against, and its
    name. A bf16 float part is timed against the backend's float32 model, not the model
    under the bf16 hint (whose "x fp32" read 1.07x for a plan 2.15x true fp32)."""
    precision, why = fallback
    option = F32_OPTIONS.get(config.backend)
    if precision != "bf16" or hook is None or option is None:
        return None, {}, None, ""
    fp32_options = {k: v for k, v in config.options.items() if k != option}
    fp32_options[BF16_FALLBACK_BACKENDS[config.backend][0]] = "f32"
    float_runner = hook(dataclasses.replace(config, options=fp32_options))
    speed_vs = f"{config.backend} CPU float32 (the float model with no bf16 part)"
    given = config.options.get(option)
    if given:
        layers = tuple(n.strip() for n in (given.split(",") if isinstance(given, str) else given))
        part = FloatPart("bf16", why, tuple(n for n in layers if n), f"given: the {option} option")
        return part, {}, float_runner, speed_vs

    def runner_for(layers: Any) -> Any:
        return hook(_with_options(config, {option: list(layers)}))

    with step("choosing the f32 layers of the bf16 float part"):
        part = choose_f32_layers(model.proto, rows, fit, target, runner_for, why)
    log.info("bf16 float part: f32 layers %s (%s)", list(part.f32_layers), part.how)
    chosen = {option: list(part.f32_layers)} if part.f32_layers else {}
    return part, chosen, float_runner, speed_vs


def _with_options(config: BuildConfig, options: Mapping[str, Any]) -> BuildConfig:
    return dataclasses.replace(config, options={**config.options, **options})


def _profile(config: BuildConfig) -> Mapping[str, Any] | None:
    return config.profiles[0] if len(config.profiles) == 1 else None


def verify_batches(
    data: Any, model: Model, config: BuildConfig
) -> list[dict[str, np.ndarray]] | None:
    """``verify_data`` read into checked batches for ``model``'s inputs (None when not given):
    any source ``enginekit.calibrate`` takes, up to 1024 samples."""
    if data is None:
        return None
    whole = _one_set(data, model)
    if whole is not None:
        return [whole]
    return list(batches(data, model.inputs, DEFAULT_BATCH, VERIFY_CAP, _profile(config)))


def _one_set(data: Any, model: Model) -> dict[str, np.ndarray] | None:
    """Arrays that are exactly one input set (every input, each of its input's rank): used as
    given, also for inputs without a batch dim (shapes, indices, scalars)."""
    specs = model.inputs
    if isinstance(data, np.ndarray) and len(specs) == 1:
        data = {specs[0].name: data}
    if not isinstance(data, Mapping) or set(data) != {s.name for s in specs}:
        return None
    arrays = {s.name: np.asarray(data[s.name]) for s in specs}
    if any(arrays[s.name].ndim != len(s.shape) for s in specs):
        return None
    if any(a.dtype != np.dtype(s.dtype) for s, a in zip(specs, arrays.values())):
        return None  # the batch reader says what is wrong
    return arrays


def verify(
    engine: Engine, model: Model, config: BuildConfig, quantized: Quantized, q: Quantization
) -> dict[str, Any]:
    """Accuracy report of an int8 engine against the float32 source model.

    On ``verify_data`` if given, else on the samples held out of ``calib_data``, else (a table
    and no data) on random inputs, where only ``max_abs_error`` is checked.
    """
    if q.verify_data is not None:
        data = batches(q.verify_data, model.inputs, DEFAULT_BATCH, VERIFY_CAP, _profile(config))
        label = "verify_data"
    elif quantized.held_out:
        # Through batches(): held-out rows are re-cut to a fixed-batch model's batch.
        data = batches(quantized.held_out, model.inputs, DEFAULT_BATCH, None, _profile(config))
        rule = f"every {HOLDOUT_EVERY}th"
        if q.target is not None:
            rule = f"every 2nd of the first {2 * SEARCH_MIN_ROWS}, then {rule}"
        label = f"held-out calibration samples ({rule})"
    else:
        if q.checked_gates.min_top1_agreement is not None:
            raise BuildError(
                "min_top1_agreement needs real data: pass verify_data= or calib_data= (random "
                "inputs say nothing about top-1 agreement)"
            )
        log.warning(
            "int8 verification on random inputs: pass verify_data= (or calib_data=) for an "
            "accuracy check on real data"
        )
        points = verification_points(model, engine.profiles)
        data = iter(make_feeds(model, s, seed=config.seed + i) for i, s in enumerate(points))
        label = "random inputs (no held-out data; only max_abs_error is checked)"
    reference, described = model, "onnxruntime-cpu float32 source model"
    if quantized.table is None and has_qdq(model.proto):  # quantization-aware: Q/DQ given
        from enginekit.calibration.convert import strip_qdq

        stripped = strip_qdq(model.proto)
        if stripped is not None:
            reference = load_model(stripped)
            described = (
                "onnxruntime-cpu float graph derived from the Q/DQ model (Q/DQ pairs removed, "
                "weights dequantized)"
            )
        else:
            described = (
                "onnxruntime-cpu on the Q/DQ model itself (no float graph could be derived): "
                "this checks the backend, not the quantization error"
            )
    with step(f"verifying int8 on {label}"):
        report = accuracy_report(engine, reference, data, q.checked_gates, label)
    report["reference"] = described
    log.info("int8 accuracy: %s", summarize(report))
    return report


__all__ = [
    "AccuracyTarget",
    "Gates",
    "Quantization",
    "Quantized",
    "check_precision",
    "has_qdq",
    "quantize",
    "verify",
    "verify_batches",
]
