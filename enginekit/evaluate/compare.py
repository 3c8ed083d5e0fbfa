"""``compare``: the same inputs through several backends and a reference, checked output by output.

Each entry (a backend name, a :class:`Candidate`, an artifact path or a loaded Engine) is built if
needed, run on every input set, and held to the reference with :func:`enginekit.verify.check_output`.
A backend that is not registered, not installed or has no such device here is reported as
skipped with its reason; one that fails to build or run is reported as an error. Golden files
(``.npz``) carry inputs and reference outputs from one machine to another.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit import backends as registry
from enginekit import target
from enginekit.config import (
    BuildConfig,
    Precision,
    ShapesArg,
    check_rule,
    default_tolerance,
    normalize_shapes,
)
from enginekit.engine import Engine, TensorSpec, to_numpy
from enginekit.errors import EngineInputError, EnginekitError, UsageError
from enginekit.evaluate.candidates import Candidate, as_candidate, skip_reason
from enginekit.evaluate.golden import Golden, load_golden, save_golden
from enginekit.evaluate.reference import resolve_reference
from enginekit.evaluate.report import BackendCheck, CaseCheck, CompareReport
from enginekit.feeds import make_feeds
from enginekit.model import Model, ModelSource, concrete_shapes, load_model, random_feeds
from enginekit.verify import DEFAULT_TOPK, check_outputs, verification_points

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]


# -- inputs --------------------------------------------------------------------------------------


def _as_cases(data: Any, names: Sequence[str]) -> list[Feeds]:
    """User data as a list of input sets: a .npz path, a mapping, one array, or a list of
    mappings (one per input set)."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise UsageError(f"data {str(path)!r}: no such .npz file")
        with np.load(path, allow_pickle=False) as z:
            return [{k: z[k] for k in z.files}]
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, Mapping) for d in data):
        return [_as_feeds(d, names) for d in data]
    return [_as_feeds(data, names)]


def _as_feeds(batch: Any, names: Sequence[str]) -> Feeds:
    if isinstance(batch, Mapping):
        return {str(k): to_numpy(v, str(k)) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if len(batch) != len(names):
            raise UsageError(
                f"data: {len(batch)} arrays given, the model takes {len(names)} ({', '.join(names)})"
            )
        return {n: to_numpy(v, n) for n, v in zip(names, batch)}
    if len(names) != 1:
        raise UsageError(f"data: one array given, the model takes {len(names)} inputs")
    return {names[0]: to_numpy(batch, names[0])}


def _check_names(cases: Sequence[Feeds], names: Sequence[str]) -> None:
    for i, case in enumerate(cases):
        if sorted(case) != sorted(names):
            raise UsageError(
                f"data set {i}: inputs {sorted(case)}, the model takes {sorted(names)}"
            )


def _check_specs(cases: Sequence[Feeds], specs: Sequence[TensorSpec]) -> None:
    """Refuse inputs of the wrong dtype, rank or fixed dim before any backend sees them, with
    the message ``Engine.infer`` gives (``enginekit run`` and ``bench`` say the same)."""
    for case in cases:
        for spec in specs:
            a = case[spec.name]
            if str(a.dtype) != spec.dtype:
                raise EngineInputError(
                    f"input {spec.name!r}: expected dtype {spec.dtype}, got {a.dtype} (cast it "
                    f"yourself, e.g. x.astype(np.{spec.dtype}); enginekit never casts silently)"
                )
            if a.ndim != len(spec.shape):
                raise EngineInputError(
                    f"input {spec.name!r}: expected rank {len(spec.shape)} {spec.shape}, got "
                    f"rank {a.ndim} with shape {a.shape}"
                )
            for axis, (want, got) in enumerate(zip(spec.shape, a.shape)):
                if isinstance(want, int) and want != got:
                    raise EngineInputError(
                        f"input {spec.name!r}: dim {axis} must be {want} (spec {spec.shape}), "
                        f"got shape {a.shape}"
                    )


def _profile_from_cases(cases: Sequence[Feeds]) -> tuple[dict[str, Any], ...]:
    """One profile spanning the data's shapes (opt = the first set's), for building backends."""
    profile = {}
    for name, first in cases[0].items():
        shapes = [c[name].shape for c in cases if name in c]
        if any(len(s) != len(first.shape) for s in shapes):
            raise UsageError(f"data: input {name!r} has different ranks across input sets")
        lo = tuple(min(d) for d in zip(*shapes))
        hi = tuple(max(d) for d in zip(*shapes))
        profile[name] = [lo, tuple(first.shape), hi]
    return tuple(normalize_shapes(profile))


def _random_points(
    model: Model | None, profiles: Sequence[Mapping[str, Any]], engines: Sequence[Engine]
) -> list[dict[str, tuple[int, ...]]]:
    """Shapes of the random input sets: min, opt and max of every profile."""
    if not profiles:
        profiles = next((e.profiles for e in engines if e.profiles), ())
    specs = model.inputs if model is not None else engines[0].inputs
    if not profiles:
        if model is None:
            return [concrete_shapes(specs, None, batch=b) for b in (1, 8)]
        return verification_points(model, ())
    points: list[dict[str, tuple[int, ...]]] = []
    for p in profiles:
        for point in ("min", "opt", "max"):
            shapes = concrete_shapes(specs, p, point)
            if shapes not in points:
                points.append(shapes)
    return points


# -- running entries -------------------------------------------------------------------------------


def _tolerance(
    precision: str, atol: float | None, rtol: float | None, gates: Mapping[str, Any]
) -> tuple[float, float, dict[str, Any]]:
    """(atol, rtol, gates) for an entry: the rule's defaults for its precision, the user's
    values where given (the cosine floor included)."""
    tol = default_tolerance(precision, gates.get("rule", "scaled"), atol, rtol)
    given = gates.get("min_cosine")
    return tol.atol, tol.rtol, {**gates, "min_cosine": tol.min_cosine if given is None else given}


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, EnginekitError) else f"{type(exc).__name__}: {exc}"


def _run_cases(
    engine: Engine,
    cases: Sequence[Feeds],
    refs: Sequence[Feeds],
    atol: float,
    rtol: float,
    gates: Mapping[str, Any],
) -> tuple[CaseCheck, ...]:
    checks = []
    for feeds, ref in zip(cases, refs):
        shapes = {k: tuple(v.shape) for k, v in feeds.items()}
        start = time.perf_counter()
        try:
            got = engine.infer(feeds)
        except Exception as exc:  # a backend's runtime failure is this entry's result
            checks.append(CaseCheck(shapes, error=_error_text(exc)))
            continue
        seconds = time.perf_counter() - start
        checks.append(
            CaseCheck(shapes, check_outputs(got, ref, atol, rtol, **gates), None, seconds)
        )
    return tuple(checks)


def _is_artifact(entry: Any) -> bool:
    if not isinstance(entry, (str, os.PathLike)):
        return False
    p = Path(entry)
    if p.is_dir():
        return (p / "manifest.json").is_file()
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # a .ekit file is a zip; an ONNX file is protobuf


def _check_engine(
    engine: Engine,
    label: str,
    cases: Sequence[Feeds],
    refs: Sequence[Feeds],
    tol: tuple[float | None, float | None],
    gates: Mapping[str, Any],
    build_s: float | None = None,
) -> BackendCheck:
    backend = engine.manifest.get("backend", {})
    precision = str(engine.manifest.get("precision", "fp32"))
    atol, rtol, gates = _tolerance(precision, *tol, gates)
    checks = _run_cases(engine, cases, refs, atol, rtol, gates)
    errors = [c.error for c in checks if c.error]
    status = "error" if errors else ("passed" if all(c.passed for c in checks) else "failed")
    return BackendCheck(
        label=label,
        backend=str(backend.get("name", type(engine).__name__)),
        status=status,
        reason="; ".join(dict.fromkeys(e for e in errors if e)),
        version=backend.get("version"),
        precision=precision,
        options=dict(engine.manifest.get("config", {}).get("options", {})),
        atol=atol,
        rtol=rtol,
        rule=str(gates.get("rule", "scaled")),
        min_cosine=gates.get("min_cosine"),
        build_s=build_s,
        cases=checks,
    )


def _check_candidate(
    cand: Candidate,
    model: Model | None,
    profiles: tuple[dict[str, Any], ...],
    device: str,
    cases: Sequence[Feeds],
    refs: Sequence[Feeds],
    tol: tuple[float | None, float | None],
    gates: Mapping[str, Any],
) -> BackendCheck:
    from enginekit.build import build

    base: dict[str, Any] = {
        "label": cand.label,
        "backend": cand.backend,
        "precision": cand.precision,
        "options": cand.options,
    }
    reason = skip_reason(cand, device)
    if reason is not None:
        return BackendCheck(**base, status="skipped", reason=reason)
    source = cand.model if cand.model is not None else model
    if source is None:
        raise UsageError(f"{cand.label}: building a backend needs the ONNX model")
    config = BuildConfig(
        backend=cand.backend,
        profiles=profiles,
        precision=cand.precision,  # type: ignore[arg-type]
        device=device,
        verify=False,
        options=dict(cand.options),
    )
    start = time.perf_counter()
    try:
        engine = build(source, config=config)
    except Exception as exc:  # any backend's build failure is this entry's result, not a crash
        log.info("%s failed to build: %s", cand.label, exc)
        return BackendCheck(**base, status="error", reason=f"build failed: {_error_text(exc)}")
    build_s = time.perf_counter() - start
    try:
        return _check_engine(engine, cand.label, cases, refs, tol, gates, round(build_s, 3))
    finally:
        engine.close()


# -- compare ---------------------------------------------------------------------------------------

Entry = str | Candidate | tuple | Engine | os.PathLike


def compare(
    model: ModelSource | None = None,
    backends: Sequence[Entry] | None = None,
    *,
    shapes: ShapesArg = None,
    data: Any = None,
    reference: str | Callable[..., Any] | None = None,
    golden: str | os.PathLike | None = None,
    save_golden_to: str | os.PathLike | None = None,
    precision: str = "fp32",
    device: str = "cpu",
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    rule: str = "scaled",
    equal_nan: bool = False,
    topk: int = DEFAULT_TOPK,
    min_cosine: float | None = None,
    min_top1: float | None = None,
    require_all: bool = False,
) -> CompareReport:
    """Run the same inputs through each backend and a reference; check every output.

    Args:
        model: the ONNX model (path, ModelProto or Model). May be None when every entry is a
            built engine and ``golden`` supplies inputs and reference outputs.
        backends: entries to compare: backend names, ``(backend, options)`` pairs,
            :class:`Candidate` objects, artifact paths or loaded Engines. None: every
            registered backend available here.
        shapes: profiles to build with; the random input sets are each profile's min, opt and
            max shapes (default: the model's shapes at batch 1 and 8).
        data: user inputs instead of random ones: a mapping name -> array, one array, an
            ``.npz`` path, or a list of mappings (one per input set).
        reference: ``"onnxruntime"`` (default: ONNX Runtime CPU FP32 on the model), another
            backend name (built at fp32), a torch module, or a callable taking the inputs as
            positional arrays in input order and returning an array, a sequence in output
            order, or a mapping name -> array.
        golden: a golden ``.npz`` (from ``save_golden_to``): its inputs and reference outputs
            replace ``data`` and ``reference``.
        save_golden_to: write the inputs and reference outputs used here to this ``.npz``.
        precision: precision to build backend names at; tolerances default to the precision's.
        device: ``cpu`` or ``cuda[:N]``.
        atol, rtol: tolerance for every entry (default: each entry's precision's for ``rule``).
        seed: seed of the random inputs.
        rule: ``scaled`` (error relative to each output's scale max|ref|, plus the cosine
            floor) or ``elementwise`` (``atol + rtol*|ref|`` per element): the same rule as
            build-time verification (docs/verification.md).
        equal_nan: accept NaN where the reference has NaN at the same place.
        topk: k of the top-k agreement on [batch, classes] outputs.
        min_cosine: cosine-similarity floor (default: the precision's under ``scaled``).
        min_top1: optional floor on top-1 agreement.
        require_all: a skipped entry fails the gate too.

    Returns:
        a :class:`CompareReport`; ``report.passed`` is the gate.
    """
    if golden is not None and (data is not None or reference is not None):
        raise UsageError("give golden= alone: it holds both the inputs and reference outputs")
    if golden is not None and save_golden_to is not None:
        raise UsageError("golden= and save_golden_to= together would only copy the file")
    Precision(precision)  # fail early on a bad name
    check_rule(rule)
    loaded = load_model(model) if model is not None else None
    profiles = normalize_shapes(shapes)
    if loaded is not None and profiles:
        from enginekit.model import check_profiles

        check_profiles(loaded, profiles)
    entries = list(backends) if backends is not None else _available_names(device)
    engines = {i: _open(e) for i, e in enumerate(entries) if _is_engine_like(e)}
    owned = [i for i, e in enumerate(entries) if _is_artifact(e)]
    try:
        gold = load_golden(golden, loaded) if golden is not None else None
        names = [s.name for s in (loaded.inputs if loaded else _any_engine(engines).inputs)]
        if gold is not None:
            cases, source = [dict(c) for c in gold.inputs], "golden"
        elif data is not None:
            cases, source = _as_cases(data, names), "data"
            _check_names(cases, names)
            _check_specs(cases, loaded.inputs if loaded else _any_engine(engines).inputs)
        else:
            points = _random_points(loaded, profiles, list(engines.values()))
            specs = loaded.inputs if loaded else _any_engine(engines).inputs
            cases = [
                make_feeds(loaded, p, seed=seed + i)
                if loaded is not None
                else random_feeds(specs, p, seed=seed + i)
                for i, p in enumerate(points)
            ]
            source = "random"
        if not profiles and source != "random":
            profiles = _profile_from_cases(cases)
        if gold is not None:
            ref_label, refs = gold.reference, [dict(c) for c in gold.outputs]
        else:
            ref = resolve_reference(reference, loaded, device, profiles)
            try:
                ref_label, refs = ref.label, [ref.run(c) for c in cases]
            finally:
                ref.close()
        if save_golden_to is not None:
            save_golden(save_golden_to, Golden(tuple(cases), tuple(refs), ref_label), loaded)
        gates = {
            "rule": rule,
            "equal_nan": equal_nan,
            "topk": topk,
            "min_cosine": min_cosine,
            "min_top1": min_top1,
        }
        checks = []
        for i, entry in enumerate(entries):
            if i in engines:
                label = str(entry) if i in owned else _engine_label(engines[i])
                checks.append(_check_engine(engines[i], label, cases, refs, (atol, rtol), gates))
            else:
                cand = as_candidate(entry)  # type: ignore[arg-type]
                if cand.precision == "fp32" and not isinstance(entry, Candidate):
                    cand = dataclasses.replace(cand, precision=precision, label="")
                checks.append(
                    _check_candidate(
                        cand, loaded, profiles, device, cases, refs, (atol, rtol), gates
                    )
                )
    finally:
        for i in owned:
            if i in engines:
                engines[i].close()
    return CompareReport(
        reference=ref_label,
        inputs=source,
        shapes=tuple({k: tuple(v.shape) for k, v in c.items()} for c in cases),
        backends=tuple(checks),
        model=(
            {"path": str(loaded.path) if loaded.path else None, "sha256": loaded.sha256}
            if loaded
            else {}
        ),
        settings={
            "precision": precision,
            "device": device,
            "atol": atol,
            "rtol": rtol,
            "seed": seed,
            "require_all": require_all,
            "golden": str(golden) if golden is not None else None,
            **gates,
        },
        host=target.host(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _available_names(device: str) -> list[Entry]:
    return [n for n in registry.names() if skip_reason(Candidate(n), device) is None]


def _is_engine_like(entry: Any) -> bool:
    if isinstance(entry, Engine) or _is_artifact(entry):
        return True
    text = os.fspath(entry) if isinstance(entry, (str, os.PathLike)) else ""
    if isinstance(entry, os.PathLike) or text.endswith(".ekit") or os.sep in text:
        raise UsageError(f"{text!r}: no such engine artifact (.ekit file or artifact directory)")
    return False


def _open(entry: Any) -> Engine:
    if isinstance(entry, Engine):
        return entry
    from enginekit.backends import load

    return load(entry)


def _any_engine(engines: Mapping[int, Engine]) -> Engine:
    if not engines:
        raise UsageError("compare needs the ONNX model unless every entry is a built engine")
    return next(iter(engines.values()))


def _engine_label(engine: Engine) -> str:
    backend = engine.manifest.get("backend", {}).get("name", type(engine).__name__)
    return f"{backend} (engine)"
