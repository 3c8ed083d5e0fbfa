"""TVM backend: the ONNX model imported into Relax, laid out NHWC, fused, scheduled and
compiled to a shared library; optionally tuned (enginekit's in-model tuner or MetaSchedule)
for the batch sizes users name.

Payload: ``model.so`` (symbolic batch: one module for every shape in the profiles),
``model-b<N>.so`` (a tuned static module per tuned batch size), ``model-static-b<N>.so``
(an untuned static module per specialized batch size, :mod:`.specialize`) and ``kernels.json`` (what the
program became, for ``enginekit inspect``); with value inputs (inputs whose values decide
shapes, :mod:`.values`) also ``model.onnx``, from which each new set of values compiles its
program at inference. Libraries are loaded only from bytes whose SHA-256
matched the manifest. See docs/backends/tvm.md.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from enginekit import target as host
from enginekit.backends import Availability, BuildResult
from enginekit.config import Precision
from enginekit.errors import ArtifactError, BackendUnavailable, BuildError
from enginekit.progress import step

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.config import BuildConfig
    from enginekit.engine import Engine
    from enginekit.model import Model

log = logging.getLogger(__name__)

NAME = "tvm"
DYNAMIC = "model.so"
#: bf16 only for LLVM targets with AVX512-BF16 (enginekit/backends/tvm/precision.py).
PRECISIONS = ("fp32", "bf16")
#: Distributions `enginekit backends` reads the version from without importing TVM (~2.5 s).
PACKAGES = ("apache-tvm", "apache-tvm-ffi")
KERNELS = "kernels.json"
#: The ONNX model, kept when value inputs need programs compiled at inference (values.py).
MODEL = "model.onnx"

OPTIONS = {
    "layout": "NHWC (default on CPU: conv2d and its neighbours in NHWC activations / HWIO "
    "weights, transposes only at the model's edges) or NCHW (the model's own layout)",
    "target": "TVM target: default this host (LLVM with its CPU detected, or CUDA on a cuda "
    "device); a dict in TVM's JSON form such as {'kind': 'llvm', 'mcpu': 'skylake-avx512'} "
    "to cross-compile; 'llvm' for generic, portable CPU code; 'cuda' or {'kind': 'cuda', "
    "'arch': 'sm_90'}",
    "tune": "tuning: {'trials': N, 'batch_sizes': [1, 8], 'method': 'enginekit' or "
    "'metaschedule', 'seconds': S} gives each listed batch size a static module tuned with N "
    "trials (enginekit: candidates of its own schedule timed in the model, within S seconds; "
    "metaschedule needs the tvm-tune extra); a tuned module serves its batch only when "
    "timed faster than the dynamic module by 'margin' (default 0.02), 'serve': 'always' "
    "serves it untimed; default: no tuning",
    "tuning_db": "directory of the tuning database to keep and reuse across builds (default: "
    "a temporary one, discarded)",
    "specialize": "static-shape modules compiled besides the dynamic one, run when a batch's "
    "shapes equal theirs: 'auto' (default: batch 1 and the profile's opt batch when an input "
    "has a symbolic dim besides the batch, such as a sequence, other dims at their opt; none "
    "otherwise), a list of batch sizes, or False (the dynamic module only)",
    "schedule": "schedules of untuned kernels: 'enginekit' (default: parallel, vectorized, "
    "register-tiled CPU schedules), 'dlight' (TVM's DLight CPU rules only) or 'none' (TVM's "
    "naive loops; for comparison)",
}


def _tvm() -> Any:
    try:
        import tvm
    except ImportError as exc:
        raise BackendUnavailable(
            f"apache-tvm is not importable ({exc}); pip install 'enginekit[tvm]'"
        ) from None
    return tvm


def available() -> Availability:
    """TVM's version and devices: cpu when LLVM codegen is built in, cuda when a GPU is seen."""
    try:
        tvm = _tvm()
    except BackendUnavailable as exc:
        return Availability(NAME, False, reason=str(exc))
    except Exception as exc:  # a broken native install raises OSError and friends
        return Availability(NAME, False, reason=f"apache-tvm fails to import: {exc}")
    devices = []
    if tvm.runtime.enabled("llvm"):
        devices.append("cpu")
    try:
        if tvm.runtime.enabled("cuda") and tvm.cuda(0).exist:
            devices.append("cuda")
    except Exception:  # no driver: not a CUDA host
        pass
    if not devices:
        return Availability(
            NAME, False, str(tvm.__version__), reason="this TVM build has neither LLVM nor CUDA"
        )
    return Availability(NAME, True, str(tvm.__version__), tuple(devices))


def supported_ops() -> list[str]:
    """ONNX ops the installed TVM's Relax frontend converts."""
    _tvm()
    from enginekit.backends.tvm.frontend import supported_ops as ops

    return ops()


# -- build -------------------------------------------------------------------------------------


def _options(config: BuildConfig) -> dict[str, Any]:
    from enginekit.backends.tvm import lower

    opts = dict(config.options)
    cuda = config.device.startswith("cuda")
    layout = str(opts.get("layout") or ("NCHW" if cuda else "NHWC")).upper()
    if layout not in lower.LAYOUTS:
        raise BuildError(
            f"layout {opts.get('layout')!r}: expected one of {', '.join(lower.LAYOUTS)}"
        )
    schedule = str(opts.get("schedule") or "enginekit")
    if schedule not in lower.SCHEDULES:
        raise BuildError(f"schedule {schedule!r}: expected one of {', '.join(lower.SCHEDULES)}")
    db = opts.get("tuning_db")
    if db is not None and not isinstance(db, (str, Path)):
        raise BuildError(f"tuning_db {db!r}: expected a directory path")
    return {
        "layout": layout,
        "schedule": schedule,
        "target": opts.get("target"),
        "db": db,
        "precision": config.precision.value,
    }


def _default_batch(config: BuildConfig, model: Model) -> int:
    for p in config.profiles:
        for _name, prof in p.items():
            if prof.opt:
                return int(prof.opt[0])
    return 1


def _cross(requirements: Mapping[str, Any], device: str) -> str | None:
    """Why the built code cannot run here (then build skips loading it), or None."""
    if requirements["kind"] == "cuda":
        return None if device.startswith("cuda") else "CUDA code built with device='cpu'"
    problems = host.missing_features(requirements)
    return "; ".join(problems) if problems else None


def _lower(
    mod: Any, target: Any, opts: dict[str, Any], workdir: Path
) -> tuple[Any, list[dict[str, Any]], set[str], list[Any]]:
    """Optimize in ``opts["layout"]`` and compile the dynamic module; returns the optimized
    graph, the kernels (before scheduling), the names of the scheduled ones and the layout
    barriers (ops kept NCHW in an NHWC build)."""
    from enginekit.backends.tvm import lower
    from enginekit.backends.tvm.specialize import compile_library

    layout = opts["layout"]
    with step(f"optimizing the Relax program ({layout}, constant folding, fusion)"):
        graph, fused, barriers = lower.optimize(mod, target, layout, opts["precision"])
    # Before scheduling, which rewrites the kernels in place (blocks split into init/update).
    kernels = lower.kernel_summary(fused)
    with step(f"compiling {DYNAMIC} for {target.kind.name} (dynamic batch)"):
        _, scheduled = compile_library(fused, target, opts, None, workdir / DYNAMIC)
    return graph, kernels, scheduled, barriers


def build(model: Model, config: BuildConfig, workdir: Path) -> BuildResult:
    """Import, lay out, fuse, schedule (and optionally tune) and compile the model."""
    _tvm()
    from enginekit.backends.tvm import lower, tune
    from enginekit.backends.tvm.specialize import parse_specialize

    if config.precision not in (Precision.FP32, Precision.BF16):
        raise BuildError(
            f"the tvm backend builds fp32 and bf16 engines; got precision "
            f"{config.precision.value}. Use precision='fp32', or the onnxruntime backend for "
            "int8/fp16"
        )
    opts = _options(config)
    target = lower.resolve_target(opts["target"], config.device)
    if config.precision == Precision.BF16:
        from enginekit.backends.tvm.precision import check_target

        check_target(target, config.device)
    requirements = lower.target_requirements(target)
    if config.device.startswith("cuda") and requirements["kind"] != "cuda":
        raise BuildError(f"device {config.device!r} needs a CUDA target, got {target.kind.name}")
    spec = tune.parse_tune(config.options.get("tune"), _default_batch(config, model))
    batches = parse_specialize(
        config.options.get("specialize"),
        model,
        config,
        _default_batch(config, model),
        spec.batch_sizes if spec is not None else (),
    )
    if spec is not None and spec.method == "metaschedule":
        tune.require_tuning_deps()
    found, example = _value_inputs(model, config)
    start = time.perf_counter()
    with step("importing ONNX into Relax"):
        mod = _import_example(model, config, found, example)
    fallback = None
    try:
        graph, kernels, scheduled, barriers = _lower(mod, target, opts, workdir)
    except BuildError as exc:
        if opts["layout"] != "NHWC":
            raise
        # NHWC is a speed option: a model TVM cannot convert, or whose converted program
        # fails later, is built in its own layout, and the manifest says why.
        fallback = f"NHWC failed, built NCHW: {exc}"
        log.warning("tvm: %s", fallback)
        opts["layout"] = "NCHW"
        graph, kernels, scheduled, barriers = _lower(mod, target, opts, workdir)
    layout = opts["layout"]
    compile_s = time.perf_counter() - start
    files = [DYNAMIC]
    modules: list[dict[str, Any]] = [{"file": DYNAMIC, "shapes": None}]
    tuning = None
    if spec is not None:
        tuned_modules, tuning = _tuned_modules(model, config, opts, target, spec, workdir, example)
        modules += tuned_modules
    specialized = None
    if batches:
        from enginekit.backends.tvm.specialize import compile_static

        verify = config.verify and not _cross(requirements, config.device)
        static, specialized = compile_static(
            model, config, opts, target, batches, workdir, example, verify
        )
        modules += static
    files += [m["file"] for m in modules[1:]]
    summary = lower.graph_summary(graph)
    kernels = [k | {"scheduled": k["name"] in scheduled} for k in kernels]
    (workdir / KERNELS).write_text(
        json.dumps({"graph": summary, "kernels": kernels}, indent=1), encoding="utf-8"
    )
    files.append(KERNELS)
    if found:
        from enginekit.backends import values

        values.save_model(workdir / MODEL, model.proto)
        files.append(MODEL)
    cross = _cross(requirements, config.device)
    metadata = {
        "layout": layout,
        "target": lower.describe_target(target),
        "schedule": opts["schedule"],
        "transposes": summary["transposes"],
        "conv_layouts": summary["conv_layouts"],
        "layout_notes": ([fallback] if fallback else []) + summary["layout_notes"],
        "layout_barriers": [b.to_json() for b in barriers],
        "precision": opts["precision"],
        "bf16_ops": _bf16_ops(graph) if opts["precision"] == "bf16" else 0,
        "kernels": len(kernels),
        "fused_kernels": sum(1 for k in kernels if k["name"].startswith("fused_")),
        "modules": modules,
        "compile_s": round(compile_s, 3),
        "tuning": tuning,
        "specialized": specialized,
        "cross_compiled": cross,
        "value_inputs": _values_metadata(found, example),
    }
    return BuildResult(files=tuple(files), metadata=metadata, target=requirements)


def _value_inputs(model: Model, config: BuildConfig) -> tuple[dict[str, str], dict[str, Any]]:
    """(value inputs -> what each feeds, their values at the first verification point).

    Raises:
        BuildError: a value input may hold more than ``values.VALUE_LIMIT`` elements.
    """
    from enginekit.backends import values
    from enginekit.backends.tvm.values import accepted, find

    found = find(model.proto)
    if not found:
        return {}, {}
    sizes = values.max_sizes(model.inputs, config.profiles)
    values.check_sizes(found, sizes, model.label, backend="TVM")
    given = config.verify_example
    example = values.example_values(model, config.profiles, config.seed, found, given)
    if given is None:  # generated values: some are invalid for the op they feed
        example = accepted(model.proto, example)
    log.info("tvm: value inputs %s, compiled for %s", list(found), values.describe(example))
    return found, example


def _import_example(
    model: Model, config: BuildConfig, found: Mapping[str, str], example: Mapping[str, Any]
) -> Any:
    """The model imported for the value inputs' ``example`` values.

    Raises:
        BuildError: the import failed; where the values were generated (no ``verify_data``),
            the error says so and asks for ``verify_data=``: generated values may be ones ONNX
            Runtime runs but that make a degenerate program (a zero-size grid from
            AffineGrid's expanded body).
    """
    from enginekit.backends import values
    from enginekit.backends.tvm import frontend

    try:
        return frontend.import_onnx(model, values=example)
    except BuildError as exc:
        if not found or config.verify_example is not None or "verify_data" in str(exc):
            raise
        raise BuildError(
            f"{exc} The value inputs {list(found)} were compiled in with generated values "
            f"({values.describe(example)}): pass verify_data= (CLI: --verify-data) with "
            "inputs the model is run with."
        ) from None


def _values_metadata(found: Mapping[str, str], example: Mapping[str, Any]) -> Any:
    from enginekit.backends import values

    return values.metadata(found, example, DYNAMIC, None, MODEL)


def _bf16_ops(graph: Any) -> int:
    from enginekit.backends.tvm.precision import count_casts

    return count_casts(graph)


def _tuned_modules(
    model: Model,
    config: BuildConfig,
    opts: dict[str, Any],
    target: Any,
    spec: Any,
    workdir: Path,
    example: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from enginekit.backends.tvm import frontend, gate, inmodel, lower, tune
    from enginekit.backends.tvm.specialize import compile_library, static_shapes, verify_static

    if target.kind.name != "llvm":
        raise BuildError("tuning is implemented for CPU (llvm) targets only")
    kept = opts["db"] is not None
    db_dir = Path(opts["db"]) if kept else Path(tempfile.mkdtemp(prefix="tvm-db-", dir=workdir))
    if not kept:
        log.info("tuning into a temporary database; pass tuning_db='dir/' to keep and reuse it")
    modules: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    start = time.perf_counter()
    for batch in spec.batch_sizes:
        shapes = static_shapes(model, config, batch)
        label = f"batch {batch}"
        knobs: dict[str, Any] | None = None
        with step(f"tuning {label} ({spec.trials} trials, {spec.method})"):
            mod = frontend.import_onnx(model, shapes, values=example)
            _, fused, _ = lower.optimize(mod, target, opts["layout"], opts["precision"])
            if spec.method == "enginekit":
                runs[str(batch)], knobs = inmodel.tune(
                    fused, target, spec.trials, db_dir, label, spec.seconds, example
                )
            else:
                runs[str(batch)] = tune.tune(fused, target, spec, db_dir, label)
        name = f"model-b{batch}.so"
        with step(f"compiling {name} with the tuned kernels"):
            database = tune.open_database(db_dir) if knobs is None else None
            tuned, _ = compile_library(fused, target, opts, database, workdir / name, knobs)
            if knobs is not None:
                tuned = sorted(runs[str(batch)].pop("changed_kernels"))
        modules.append(
            {
                "file": name,
                "shapes": {k: list(v) for k, v in shapes.items()},
                "tuned_kernels": tuned,
                "batch": batch,
            }
        )
    here = not _cross(lower.target_requirements(target), config.device)
    modules, serving = gate.serve(model, config, spec, modules, workdir, DYNAMIC, example, here)
    if config.verify and here and modules:
        with step("verifying the tuned modules against ONNX Runtime CPU"):
            verify_static(model, config, modules, workdir, example)
    tuning = {
        "method": spec.method,
        "trials": spec.trials,
        "seconds_budget": spec.seconds,
        "batch_sizes": list(spec.batch_sizes),
        "database": str(db_dir) if kept else None,
        "seconds": round(time.perf_counter() - start, 2),
        "trials_run": sum(r["trials_run"] for r in runs.values()),
        "runs": runs,
        "serving": serving,
    }
    return modules, tuning


# -- load --------------------------------------------------------------------------------------


def load(artifact: Artifact, device: str) -> Engine:
    """Relax VMs over the artifact's libraries, each loaded only after its checksum matched.

    Raises:
        ArtifactError: the host lacks the target's CPU features or GPU, or a library is
            tampered with or does not load.
    """
    _tvm()
    from enginekit.backends.tvm.runtime import TvmEngine, load_library

    manifest = artifact.manifest
    target = manifest.get("target", {})
    meta = manifest.get("backend", {}).get("metadata", {})
    if target.get("kind") == "cuda" and not device.startswith("cuda"):
        raise ArtifactError(
            f"{artifact.path}: built for CUDA ({target.get('arch', '?')}); load it with "
            "device='cuda' on a GPU host"
        )
    if target.get("kind", "cpu") == "cpu" and device.startswith("cuda"):
        raise ArtifactError(f"{artifact.path}: built for CPU; load it with device='cpu'")
    # Checked here too (enginekit.load does it as well) so that no code path executes native
    # code built for features this CPU lacks.
    problems = host.missing_features(target)
    if problems:
        raise ArtifactError(
            f"{artifact.path}: built for a host with {'; '.join(problems)}; rebuild it here "
            "(or build with target='llvm' for portable code)"
        )
    modules = meta.get("modules") or [{"file": DYNAMIC, "shapes": None}]
    dynamic = None
    static = []
    for entry in modules:
        lib = load_library(artifact, entry["file"])
        if entry.get("shapes") is None:
            dynamic = lib
        else:
            static.append(({k: tuple(v) for k, v in entry["shapes"].items()}, lib))
    if dynamic is None:
        raise ArtifactError(f"{artifact.path}: the manifest lists no dynamic module ({DYNAMIC})")
    compiler, build_values = _compiler(artifact, meta)
    return TvmEngine(manifest, dynamic, static, device, compiler, build_values)


def _compiler(artifact: Artifact, meta: Mapping[str, Any]) -> tuple[Any, Any]:
    """For an artifact with value inputs: what compiles a program for new values, and the
    values its stored program was compiled for; (None, None) otherwise."""
    spec = meta.get("value_inputs")
    if not spec:
        return None, None
    from enginekit.backends.tvm.values import Compiler, Recipe
    from enginekit.backends.values import from_json

    inputs = artifact.manifest["inputs"]
    names = tuple(i["name"] for i in inputs if i["name"] in spec["inputs"])
    dtypes = {i["name"]: i["dtype"] for i in inputs}
    compiler = Compiler(artifact.read(spec["model"]), dtypes, names, Recipe.from_metadata(meta))
    stored = spec["programs"]
    return compiler, from_json(stored[0]["values"]) if stored else None


# -- inspect -----------------------------------------------------------------------------------


def inspect(artifact: Artifact, ir: bool = False) -> dict[str, Any]:
    """What the program became: layout, transposes left, fused kernels, tuned modules.

    Reads ``kernels.json`` (checksum verified); loads no native code.
    """
    meta = artifact.manifest.get("backend", {}).get("metadata", {})
    details = json.loads(artifact.read(KERNELS)) if KERNELS in artifact.payload_names else {}
    kernels = details.get("kernels", [])
    fused = [k["name"] for k in kernels if k["name"].startswith("fused_")]
    info: dict[str, Any] = {
        "layout": meta.get("layout"),
        "transposes": meta.get("transposes"),
        "conv_layouts": meta.get("conv_layouts"),
        "layout_notes": meta.get("layout_notes", []),
        "layout_barriers": meta.get("layout_barriers", []),
        "target": meta.get("target"),
        "kernels": len(kernels),
        "fused": fused,
        "modules": [
            {"file": m["file"], "shapes": m.get("shapes") or "dynamic"}
            | ({"tuned_kernels": len(m["tuned_kernels"])} if "tuned_kernels" in m else {})
            | ({"specialized": True} if m.get("specialized") else {})
            for m in meta.get("modules", [])
        ],
        "tuning": meta.get("tuning"),
        "serving": {
            f"batch {b}": d["decision"]
            for b, d in ((meta.get("tuning") or {}).get("serving") or {}).items()
        }
        or None,
        "specialized": meta.get("specialized"),
        "value_inputs": (meta.get("value_inputs") or {}).get("inputs"),
    }
    if ir:
        info["kernel_blocks"] = {k["name"]: k["blocks"] for k in kernels}
        info["relax_ops"] = details.get("graph", {}).get("ops", {})
    return info


# -- profile -----------------------------------------------------------------------------------


def profile(artifact: Artifact, feeds: dict[str, Any], runs: int, warmup: int) -> list[Any]:
    """Per-kernel times from the Relax VM's call instrument (:mod:`.profiler`)."""
    from enginekit.backends.tvm import profiler
    from enginekit.backends.tvm.runtime import TvmEngine

    engine = load(artifact, "cpu")
    try:
        return profiler.profile(cast(TvmEngine, engine), feeds, runs, warmup)
    finally:
        engine.close()
