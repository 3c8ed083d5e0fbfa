"""``--backend auto``: build every candidate, verify each, bench the ones that pass, keep the best.

Candidates default to every registered backend (or those in ``backends=``) at every precision
this host runs well: fp32, bf16 where the CPU has bf16 instructions, int8 when calibration data
is given (:func:`enginekit.evaluate.agreement.host_precisions`); they can be given explicitly as
(backend, options) pairs or :class:`Candidate` objects. A candidate that cannot be built here,
fails to build, fails verification, misses the accuracy gate (reduced precisions: top-1
agreement with float32 on one shared batch, :mod:`enginekit.evaluate.agreement`) or fails to run
is recorded with its reason and never chosen. The winner's manifest gets ``auto``: every
candidate's result, speed and agreement, the objective, why the winner won and why each other
candidate lost.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from enginekit import backends as registry
from enginekit.artifact import write_artifact
from enginekit.backends import load
from enginekit.build import Request, build
from enginekit.calibration.plan import Quantization
from enginekit.calibration.search import BF16_FALLBACK_BACKENDS, fallback_precision
from enginekit.config import BuildConfig
from enginekit.engine import Engine
from enginekit.errors import BuildError, EnginekitError, UsageError, VerificationError
from enginekit.evaluate import agreement
from enginekit.evaluate.bench import bench_many, max_batch
from enginekit.evaluate.candidates import Candidate, as_candidate, skip_reason
from enginekit.evaluate.report import BatchResult
from enginekit.model import Model, ModelSource, load_model
from enginekit.verify import summarize, verify_engine

log = logging.getLogger(__name__)

OBJECTIVES = ("latency", "throughput")


def default_candidates(
    precisions: Sequence[str],
    options: Mapping[str, Any] | None = None,
    backends: Sequence[str] | None = None,
) -> list[tuple[Candidate, list[str]]]:
    """Every registered backend (or each of ``backends``) at every precision, each with the
    ``options`` it knows; returned with the option names it does not know (dropped for it).

    Raises:
        UnknownBackend: a name in ``backends`` is not registered (the closest one suggested).
    """
    for name in backends or ():
        registry.check_name(name)
    out = []
    for name in backends or registry.names():
        try:
            known = set(getattr(registry.get(name), "OPTIONS", {}))
        except EnginekitError:
            known = set()
        mine = {k: v for k, v in (options or {}).items() if k in known}
        dropped = sorted(set(options or {}) - known)
        for p in precisions:
            out.append((Candidate(name, mine, p), dropped))
    return out


def _max_abs(report: Mapping[str, Any]) -> float | None:
    values = [
        o.get("max_abs") for c in report.get("cases", []) for o in c.get("outputs", {}).values()
    ]
    finite = [v for v in values if v is not None]
    return max(finite) if finite and len(finite) == len(values) else None


def _verify_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    worst = report.get("worst") or {}
    scaled = [o.get("scaled_error") for o in worst.values()]
    cosines = [o["cosine"] for o in worst.values() if o.get("cosine") is not None]
    return {
        "passed": report.get("passed"),
        "rule": report.get("rule"),
        "atol": report.get("atol"),
        "rtol": report.get("rtol"),
        "max_abs": _max_abs(report),
        "scaled_error": max(scaled) if scaled and None not in scaled else None,
        "cosine": min(cosines) if cosines else None,
        "cases": len(report.get("cases", [])),
    }


def _bench_batch(engine: Engine, objective: str) -> int:
    """Batch size to rank at: the opt shape's for latency, the largest profile's for throughput."""
    if engine.profiles and engine.inputs:
        prof = engine.profiles[0].get(engine.inputs[0].name)
        if prof is not None and prof.opt:
            if objective == "throughput":
                return max_batch(engine) or prof.max[0]
            return prof.opt[0]
    first = engine.inputs[0].shape[0] if engine.inputs and engine.inputs[0].shape else 1
    if isinstance(first, int):
        return first
    return 32 if objective == "throughput" else 1


def _score(result: BatchResult, objective: str) -> float:
    """Lower is better: p50 latency in ms, or negated samples/s."""
    if result.latency_ms is None:
        return math.inf
    return result.latency_ms.p50 if objective == "latency" else -result.throughput


def _reason(ranked: list[tuple[dict[str, Any], BatchResult]], objective: str, batch: int) -> str:
    first, best = ranked[0]
    if len(ranked) == 1:
        return f"{first['label']}: the only candidate that built, passed verification and ran"
    second, runner = ranked[1]
    if objective == "latency":
        a, b = best.latency_ms.p50, runner.latency_ms.p50  # type: ignore[union-attr]
        text = (
            f"{first['label']} has the lowest p50 latency at batch {batch}: {a:.4g} ms vs "
            f"{b:.4g} ms for {second['label']} ({b / a:.2f}x)"
        )
        ratio = b / a
    else:
        a, b = best.throughput, runner.throughput
        text = (
            f"{first['label']} has the highest throughput at batch {batch}: {a:.5g} vs {b:.5g} "
            f"samples/s for {second['label']} ({a / b:.2f}x)"
        )
        ratio = a / b
    noise = max((r.spread or 0.0) for r in (best, runner))
    if ratio - 1.0 <= noise:
        text += (
            f"; within measurement noise (rounds spread {noise:.0%}): a longer bench duration "
            "may order them differently"
        )
    return text


def bf16_float_part(
    todo: Sequence[tuple[Candidate, list[str]]], quant: Quantization
) -> tuple[list[tuple[Candidate, list[str]]], str]:
    """With an accuracy target, each default int8 candidate on a backend that can run an int8
    model's float part in bf16 (``BF16_FALLBACK_BACKENDS``) also as a candidate that does, on
    a host with native bf16 (the search then picks the layers kept f32 inside it,
    :mod:`enginekit.calibration.mixed`); and what was done, or why not, for the manifest.

    Why a separate candidate and not the search's default: a bf16 float part ties the artifact
    to CPUs with native bf16 and changes its numerics; auto verifies and benches it beside the
    float32 one and keeps it only where it passes and is faster.
    """
    target = quant.target
    if target is None:
        return [], "not tried: no accuracy target (it chooses the f32 layers of a bf16 part)"
    if target.fallback == "float":
        return [], "not tried: the accuracy target's fallback is float"
    added: list[tuple[Candidate, list[str]]] = []
    why = "not tried: no int8 candidate on a backend that runs the float part in bf16"
    for cand, dropped in todo:
        switch = BF16_FALLBACK_BACKENDS.get(cand.backend)
        if cand.precision != "int8" or switch is None or switch[0] in cand.options:
            continue
        options = {**cand.options, switch[0]: switch[1]}
        try:
            precision, reason = fallback_precision(target, cand.backend, options=options)
        except BuildError as exc:
            precision, reason = "float", str(exc)
        if precision != "bf16":
            why = f"not tried: {reason}"
            continue
        added.append((Candidate(cand.backend, options, "int8", cand.model), dropped))
        why = f"tried as {added[-1][0].label}: {reason}"
    return added, why


def _has_qdq(model: Model) -> bool:
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.proto.graph.node)


def build_args(cand: Candidate, quant: Quantization) -> dict[str, Any]:
    """The keyword arguments of :func:`enginekit.build` a candidate's build gets beyond its
    config — the one place build options reach each candidate.

    int8 candidates get the int8 arguments (calibration table or data, verification data,
    the accuracy gates, an accuracy target); the others none (their verification runs here, on the main model).
    """
    if cand.precision != "int8":
        return {}
    return {
        "calibration": quant.calibration,
        "calib_data": quant.calib_data,
        "calib_method": quant.calib_method,
        "verify_data": quant.verify_data,
        "min_top1_agreement": quant.gates.min_top1_agreement,
        "max_abs_error": quant.gates.max_abs_error,
        "allow_table_mismatch": quant.allow_table_mismatch,
        "accuracy_target": quant.target,
    }


def _build_one(
    cand: Candidate,
    model: Model,
    base: BuildConfig,
    out_dir: Path,
    quant: Quantization | None = None,
) -> tuple[Engine | None, dict[str, Any]]:
    config = BuildConfig(
        backend=cand.backend,
        profiles=base.profiles,
        precision=cand.precision,  # type: ignore[arg-type]
        device=base.device,
        verify=False,  # verified below against the main model, also for a model variant
        atol=base.atol,
        rtol=base.rtol,
        seed=base.seed,
        options=dict(cand.options),
    )
    record: dict[str, Any] = {**cand.to_json(), "status": "skipped", "error": None}
    reason = skip_reason(cand, base.device)
    quant = quant or Quantization()
    calibrated = quant.calibration is not None or quant.calib_data is not None
    if reason is None and cand.precision == "int8" and not calibrated and not _has_qdq(model):
        reason = (
            "int8 needs calibration data: give calib_data= or calibration= (--calib-data, "
            "--calibration) with auto"
        )
    if reason is not None:
        record["error"] = reason
        return None, record
    source = cand.model if cand.model is not None else model
    try:
        if cand.precision == "int8" and calibrated:
            # build's own int8 stage calibrates and verifies on data, with the accuracy gates
            config = dataclasses.replace(config, verify=True)
            engine = build(source, config=config, output=f"{out_dir}/", **build_args(cand, quant))
            report = engine.manifest["verify"]
        else:
            engine = build(source, config=config, output=f"{out_dir}/", **build_args(cand, quant))
            report = verify_engine(engine, model, dataclasses.replace(config, verify=True))
    except VerificationError as exc:
        record.update(status="failed verification", error=str(exc))
        return None, record
    except Exception as exc:  # any backend's build or run failure is this candidate's result
        text = str(exc) if isinstance(exc, EnginekitError) else f"{type(exc).__name__}: {exc}"
        record.update(status="build error", error=text)
        return None, record
    record["verify"] = _verify_summary(report)
    record["build_s"] = engine.manifest.get("build", {}).get("build_s")
    if not report["passed"]:
        engine.close()
        record.update(status="failed verification", error=summarize(report))
        return None, record
    engine.manifest = {**engine.manifest, "verify": report}
    record["status"] = "passed"
    return engine, record


def build_auto(model: ModelSource, request: Request) -> Engine:
    """Build every candidate, verify, gate and bench each, write and return the best one.

    ``enginekit.build(model, backend="auto", ...)`` lands here with build's arguments as a
    :class:`~enginekit.build.Request`; these options of ``request.config`` are auto's own:

    Args:
        candidates: what to try: backend names, ``(backend, options[, precision])`` tuples or
            :class:`Candidate` objects (default: every registered backend, at each precision).
        backends: the backends of the default candidates (default: every registered one).
        precisions: precisions to try each default candidate at (default: every precision
            this host runs well — fp32; bf16 where the CPU has bf16 instructions; int8 with
            calibration data — or the config's precision when it is not fp32).
        objective: ``latency`` (p50 at the opt shape; default) or ``throughput`` (samples/s at
            the largest profile batch).
        bench_duration: timed seconds per candidate, shared across ``bench_rounds`` rounds.
        bench_rounds: timed rounds (default 3).

    Every other option goes to each default candidate whose backend knows it. The int8
    arguments (``calibration``, ``calib_data``, ``verify_data``, the accuracy gates) go to
    every int8 candidate (:func:`build_args`), which build's int8 stage calibrates and verifies
    on data; an int8 candidate without calibration (and a model without Q/DQ nodes) is
    skipped, saying so. Every candidate that passes then runs one shared batch (``verify_data``,
    else the calibration rows held out, else generated inputs); a reduced-precision one whose
    top-1 agreement with float32 falls below ``min_top1_agreement`` (default 0.99) is never
    chosen.

    Raises:
        UsageError: verify off (auto verifies every candidate), a bad objective.
        UnknownBackend: a name in ``backends`` that no backend is registered under.
        BuildError: subgraph arguments (they apply to one backend), or no candidate could be
            built here.
        VerificationError: every candidate that built failed verification or the gate.
    """
    config = request.config
    if config.outputs or not config.simplify:
        raise BuildError(
            "simplify=False and outputs= apply to one backend's build; name the backend "
            "instead of 'auto'"
        )
    if not config.verify:
        raise UsageError("--backend auto verifies every candidate; it cannot run with verify off")
    options = dict(config.options)
    candidates: Sequence[Any] | None = options.pop("candidates", None)
    backends: Sequence[str] | str | None = options.pop("backends", None)
    precisions: Sequence[str] | None = options.pop("precisions", None)
    objective: str = options.pop("objective", "latency")
    bench_duration: float = options.pop("bench_duration", 1.0)
    bench_rounds: int = options.pop("bench_rounds", 3)
    if objective not in OBJECTIVES:
        raise UsageError(f"objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if isinstance(backends, str):
        backends = [b.strip() for b in backends.split(",") if b.strip()]
    if candidates and backends:
        raise UsageError("give candidates= (each names its backend) or backends=, not both")
    loaded = load_model(model)
    quant = request.quant
    calibrated = quant.calibration is not None or quant.calib_data is not None or _has_qdq(loaded)
    left_out: dict[str, str] = {}
    if precisions is None and config.precision.value == "fp32" and not candidates:
        chosen, left_out = agreement.host_precisions(config.device, calibrated)
    else:
        chosen = list(precisions or [config.precision.value])
    base = dataclasses.replace(config, options={})
    todo: list[tuple[Candidate, list[str]]] = (
        [(as_candidate(c), []) for c in candidates]
        if candidates
        else default_candidates(chosen, options, backends)
    )
    floor = quant.checked_gates.min_top1_agreement  # the gate's, else an accuracy target's
    mixed: list[tuple[Candidate, list[str]]] = []
    why_mixed = "not tried: candidates given"
    if not candidates:
        mixed, why_mixed = bf16_float_part(todo, quant)
        todo = [*todo, *mixed]
    auto: dict[str, Any] = {
        "objective": objective,
        "precisions": chosen if not candidates else sorted({c.precision for c, _ in todo}),
        "precisions_left_out": left_out,
        "min_top1_agreement": agreement.DEFAULT_MIN_TOP1 if floor is None else floor,
        "bf16_float_part": why_mixed,
    }
    root = Path(tempfile.mkdtemp(prefix="enginekit-auto-"))
    built: list[tuple[Engine, dict[str, Any], Path]] = []
    records: list[dict[str, Any]] = []
    try:
        for i, (cand, dropped) in enumerate(todo):
            engine, record = _build_one(cand, loaded, base, root / f"c{i}", quant)
            if dropped:
                record["dropped_options"] = dropped
            records.append(record)
            if engine is not None:
                built.append((engine, record, root / f"c{i}"))
        built = _gate(built, loaded, base, quant, auto, objective)
        auto["candidates"] = records
        return _choose(built, auto, objective, bench_duration, bench_rounds, request.output, root)
    except BaseException:
        for engine, _, _ in built:
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
        raise


def _gate(
    built: list[tuple[Engine, dict[str, Any], Path]],
    model: Model,
    base: BuildConfig,
    quant: Quantization,
    auto: dict[str, Any],
    objective: str,
) -> list[tuple[Engine, dict[str, Any], Path]]:
    """Every built candidate on the shared batch: its agreement recorded, and a reduced
    precision below the top-1 floor dropped (closed, its record saying why)."""
    if not built:
        return built
    profile = base.profiles[0] if len(base.profiles) == 1 else None
    chunks, described = agreement.batch(
        model, profile, _bench_batch(built[0][0], objective), quant.verify_data,
        quant.calib_data, base.seed,
    )  # fmt: skip
    ref = agreement.reference(model, chunks)
    auto["agreement_data"] = described
    kept = []
    for engine, record, path in built:
        try:
            found = agreement.measure(engine, chunks, ref)
        except Exception as exc:  # a run failure on real data is this candidate's result
            text = str(exc) if isinstance(exc, EnginekitError) else f"{type(exc).__name__}: {exc}"
            record.update(status="run error", error=text)
            engine.close()
            continue
        record["agreement"] = found.to_json()
        why = agreement.gate(record["precision"], found, auto["min_top1_agreement"])
        if why is not None:
            record.update(status="failed accuracy gate", error=why)
            engine.close()
            continue
        kept.append((engine, record, path))
    return kept


def _choose(
    built: list[tuple[Engine, dict[str, Any], Path]],
    auto: dict[str, Any],
    objective: str,
    duration: float,
    rounds: int,
    output: str | os.PathLike | None,
    root: Path,
) -> Engine:
    records: list[dict[str, Any]] = auto["candidates"]
    if not built:
        _fail(auto, records)
    batch = _bench_batch(built[0][0], objective)
    results = bench_many(
        [e for e, _, _ in built],
        [batch],
        duration=duration,  # per candidate; rounds interleave the candidates
        warmup=min(0.2, duration / 4),
        rounds=rounds,
        labels=[r["label"] for _, r, _ in built],
    )
    ranked = []
    for (_, record, _), res in zip(built, results):
        r = res.results[0]
        record["bench"] = r.to_json()
        if r.error is not None:
            record.update(status="bench error", error=r.error)
        else:
            record["score"] = _score(r, objective)
            ranked.append((record, r, res))
    if not ranked:
        _fail(auto, records)
    ranked.sort(key=lambda t: t[0]["score"])
    winner_record, winner_result, winner_bench = ranked[0]
    auto.update(
        metric="p50 latency (ms)" if objective == "latency" else "throughput (samples/s)",
        batch=batch,
        shapes={k: list(v) for k, v in winner_result.shapes.items()},
        bench={"duration_s": duration, "rounds": rounds},
        winner=winner_record["label"],
        reason=_reason([(rec, r) for rec, r, _ in ranked], objective, batch),
    )
    _verdicts(records, [(rec, r) for rec, r, _ in ranked], objective, auto["reason"])
    index = next(i for i, (_, rec, _) in enumerate(built) if rec is winner_record)
    winner, _, winner_dir = built[index]
    for i, (engine, _, _) in enumerate(built):
        if i != index:
            engine.close()
    manifest = {**winner.manifest, "auto": auto, "bench": winner_bench.to_json()}
    if output is not None:
        files = list(manifest.get("payload", {}))
        written = write_artifact(output, manifest, winner_dir / "payload", files)
        winner.close()
        shutil.rmtree(root, ignore_errors=True)
        return load(written)
    winner.manifest = manifest
    # The engine may map payload files (native libraries): keep them until it is gone.
    weakref.finalize(winner, shutil.rmtree, root, True)
    return winner


def _verdicts(
    records: list[dict[str, Any]],
    ranked: list[tuple[dict[str, Any], BatchResult]],
    objective: str,
    reason: str,
) -> None:
    """Each candidate's ``verdict``: why it won, or why it lost (slower by how much, or the
    stage it failed at)."""
    best = ranked[0][1] if ranked else None
    for rec in records:
        rec["verdict"] = f"lost: {rec['status']}: {rec.get('error')}"
    for i, (rec, r) in enumerate(ranked):
        if i == 0:
            rec["verdict"] = f"won: {reason}"
        elif best is not None and objective == "latency" and r.latency_ms and best.latency_ms:
            a, b = best.latency_ms.p50, r.latency_ms.p50
            rec["verdict"] = (
                f"lost: slower, p50 {b:.4g} ms vs the winner's {a:.4g} ms ({b / a:.2f}x)"
            )
        elif best is not None and r.throughput:
            a, b = best.throughput, r.throughput
            rec["verdict"] = (
                f"lost: lower throughput, {b:.5g} vs the winner's {a:.5g} samples/s ({a / b:.2f}x)"
            )


def _fail(auto: dict[str, Any], records: list[dict[str, Any]]) -> NoReturn:
    _verdicts(records, [], auto["objective"], "")
    lines = "; ".join(f"{r['label']}: {r['status']} ({r.get('error')})" for r in records)
    if any(r["status"] in ("failed verification", "failed accuracy gate") for r in records):
        raise VerificationError(
            f"--backend auto: no candidate passed verification and ran: {lines}", {"auto": auto}
        )
    raise BuildError(f"--backend auto: no candidate could be built and run here: {lines or 'none'}")
