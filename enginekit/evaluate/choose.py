"""``--backend auto``: build every candidate, verify each, bench the ones that pass, keep the best.

Candidates default to every registered backend available here, at each precision asked for;
they can be given explicitly as (backend, options) pairs or :class:`Candidate` objects. A
candidate that cannot be built here, fails to build, fails verification or fails to run is
recorded with its reason and never chosen. The winner's manifest gets ``auto``: every
candidate's result, the objective, and why the winner won.
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
from enginekit.config import BuildConfig
from enginekit.engine import Engine
from enginekit.errors import BuildError, EnginekitError, UsageError, VerificationError
from enginekit.evaluate.bench import bench_many, max_batch
from enginekit.evaluate.candidates import Candidate, as_candidate, skip_reason
from enginekit.evaluate.report import BatchResult
from enginekit.model import Model, ModelSource, load_model
from enginekit.verify import summarize, verify_engine

log = logging.getLogger(__name__)

OBJECTIVES = ("latency", "throughput")


def default_candidates(
    precisions: Sequence[str], options: Mapping[str, Any] | None = None
) -> list[tuple[Candidate, list[str]]]:
    """Every registered backend at every precision, each with the ``options`` it knows;
    returned with the option names it does not know (dropped for it)."""
    out = []
    for name in registry.names():
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


def _has_qdq(model: Model) -> bool:
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.proto.graph.node)


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
            engine = build(
                source, config=dataclasses.replace(config, verify=True), output=f"{out_dir}/",
                calibration=quant.calibration, calib_data=quant.calib_data,
                calib_method=quant.calib_method, verify_data=quant.verify_data,
                min_top1_agreement=quant.gates.min_top1_agreement,
                max_abs_error=quant.gates.max_abs_error,
                allow_table_mismatch=quant.allow_table_mismatch,
            )  # fmt: skip
            report = engine.manifest["verify"]
        else:
            engine = build(source, config=config, output=f"{out_dir}/")
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
    """Build every candidate, verify and bench each, write and return the best one.

    ``enginekit.build(model, backend="auto", ...)`` lands here with build's arguments as a
    :class:`~enginekit.build.Request`; these options of ``request.config`` are auto's own:

    Args:
        candidates: what to try: backend names, ``(backend, options[, precision])`` tuples or
            :class:`Candidate` objects (default: every registered backend, at each precision).
        precisions: precisions to try each default candidate at (default: the config's).
        objective: ``latency`` (p50 at the opt shape; default) or ``throughput`` (samples/s at
            the largest profile batch).
        bench_duration: timed seconds per candidate, shared across ``bench_rounds`` rounds.
        bench_rounds: timed rounds (default 3).

    Every other option goes to each default candidate whose backend knows it.

    Raises:
        UsageError: verify off (auto verifies every candidate), a bad objective.
        BuildError: subgraph arguments (they apply to one backend), or no candidate could be
            built here.

    The int8 arguments (``calibration``, ``calib_data``, ``verify_data``, the accuracy gates)
    go to every int8 candidate, which build's int8 stage calibrates and verifies on data; an
    int8 candidate without calibration (and a model without Q/DQ nodes) is skipped, saying so.
        VerificationError: every candidate that built failed verification.
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
    precisions: Sequence[str] | None = options.pop("precisions", None)
    objective: str = options.pop("objective", "latency")
    bench_duration: float = options.pop("bench_duration", 1.0)
    bench_rounds: int = options.pop("bench_rounds", 3)
    if objective not in OBJECTIVES:
        raise UsageError(f"objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    loaded = load_model(model)
    base = dataclasses.replace(config, options={})
    output = request.output
    todo: list[tuple[Candidate, list[str]]] = (
        [(as_candidate(c), []) for c in candidates]
        if candidates
        else default_candidates(list(precisions or [config.precision.value]), options)
    )
    root = Path(tempfile.mkdtemp(prefix="enginekit-auto-"))
    built: list[tuple[Engine, dict[str, Any], Path]] = []
    records: list[dict[str, Any]] = []
    try:
        for i, (cand, dropped) in enumerate(todo):
            engine, record = _build_one(cand, loaded, base, root / f"c{i}", request.quant)
            if dropped:
                record["dropped_options"] = dropped
            records.append(record)
            if engine is not None:
                built.append((engine, record, root / f"c{i}"))
        return _choose(built, records, objective, bench_duration, bench_rounds, output, root)
    except BaseException:
        for engine, _, _ in built:
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
        raise


def _choose(
    built: list[tuple[Engine, dict[str, Any], Path]],
    records: list[dict[str, Any]],
    objective: str,
    duration: float,
    rounds: int,
    output: str | os.PathLike | None,
    root: Path,
) -> Engine:
    auto: dict[str, Any] = {"objective": objective, "candidates": records}
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


def _fail(auto: dict[str, Any], records: list[dict[str, Any]]) -> NoReturn:
    lines = "; ".join(f"{r['label']}: {r['status']} ({r.get('error')})" for r in records)
    if any(r["status"] == "failed verification" for r in records):
        raise VerificationError(
            f"--backend auto: no candidate passed verification and ran: {lines}", {"auto": auto}
        )
    raise BuildError(f"--backend auto: no candidate could be built and run here: {lines or 'none'}")
