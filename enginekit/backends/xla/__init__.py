"""XLA backend: ONNX lowered to JAX (NHWC convolutions), exported once as StableHLO with symbolic
batch/sequence dims, compiled by XLA per shape bucket on first use.

Payload: ``model.stablehlo`` (``jax.export`` serialization: StableHLO bytecode plus calling
convention, no pickle) and ``weights.safetensors`` (the weights, already in the layout the
program takes them in). Build-time measurements pick the layout and the XLA compiler options;
both are recorded in the manifest and every executable of the engine is compiled with them.

This module imports jax only inside functions: ``import enginekit`` never pays for it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.backends import Availability, BuildResult
from enginekit.errors import ArtifactError, BackendUnavailable, BuildError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.backends.xla.runtime import XlaEngine
    from enginekit.config import BuildConfig
    from enginekit.engine import Engine, TensorSpec
    from enginekit.model import Model

log = logging.getLogger(__name__)

NAME = "xla"
PROGRAM = "model.stablehlo"
WEIGHTS = "weights.safetensors"
#: The ONNX model, kept when value inputs need programs lowered at inference (values.py).
MODEL = "model.onnx"
#: bf16/fp16: weights and activations in that type, statistics and softmax in float32
#: (``lower.WIDE_OPS``); inputs and outputs stay float32. Verification gates them.
PRECISIONS = ("fp32", "bf16", "fp16")
#: Distributions `enginekit backends` reads the version from without importing jax.
PACKAGES = ("jax", "jaxlib", "safetensors")
#: Layout used when the ``layout`` option is not given (measured: benchmarks/xla.py).
DEFAULT_LAYOUT = "nhwc"

OPTIONS = {
    "layout": "convolution layout: nhwc (default; activations stay channels-last between convs, "
    "transposed once at the model's edges), nchw, or auto (measure both at build time)",
    "xla_flags": "XLA compiler options per executable: auto (default: time each candidate set at "
    "build time, keep the fastest), a set name (xla-default, ynn-off), or a dict of XLA debug "
    "options such as {'xla_cpu_experimental_ynn_fusion_type': ''}",
    "buckets": "pow2 (default: batch sizes pad up to powers of two, so batches 1..N compile "
    "log2(N)+1 programs) or exact (one program per batch size, no padding)",
    "cache_dir": "JAX persistent compilation cache directory to use on load (process-wide; only "
    "point it at a directory you trust)",
    "precompile": "compile on load instead of on first use: 'buckets' (every batch bucket of "
    "the profiles) or a list of batch sizes",
}

_LAYOUTS = ("nhwc", "nchw", "auto")
_BUCKETS = ("pow2", "exact")


@dataclasses.dataclass(frozen=True)
class _Options:
    layout: str
    xla_flags: Any
    buckets: str
    cache_dir: str | None
    precompile: Any


def _parse_options(options: Mapping[str, Any]) -> _Options:
    from enginekit.backends.xla.tune import FLAG_SETS

    layout = str(options.get("layout", DEFAULT_LAYOUT)).lower()
    if layout not in _LAYOUTS:
        raise BuildError(f"xla option layout={layout!r}: expected one of {', '.join(_LAYOUTS)}")
    flags = options.get("xla_flags", "auto")
    if isinstance(flags, str) and flags != "auto" and flags not in FLAG_SETS:
        raise BuildError(
            f"xla option xla_flags={flags!r}: expected auto, {', '.join(FLAG_SETS)} or a dict "
            "of XLA options"
        )
    if not isinstance(flags, (str, Mapping)):
        raise BuildError(f"xla option xla_flags: expected a name or a dict, got {flags!r}")
    buckets = str(options.get("buckets", "pow2"))
    if buckets not in _BUCKETS:
        raise BuildError(f"xla option buckets={buckets!r}: expected pow2 or exact")
    precompile = options.get("precompile")
    if precompile not in (None, "buckets") and not (
        isinstance(precompile, (list, tuple))
        and all(isinstance(b, int) and b > 0 for b in precompile)
    ):
        raise BuildError(
            f"xla option precompile={precompile!r}: expected 'buckets' or a list of batch sizes"
        )
    cache_dir = options.get("cache_dir")
    return _Options(layout, flags, buckets, str(cache_dir) if cache_dir else None, precompile)


def _jax() -> Any:
    try:
        import jax
    except ImportError as exc:
        raise BackendUnavailable(
            f"jax is not importable ({exc}); pip install 'enginekit[jax]' (jax[cpu]), or "
            "jax[cuda12] for NVIDIA GPUs"
        ) from None
    return jax


def available() -> Availability:
    """jax's version and devices (``cuda`` only where jax sees a GPU)."""
    if importlib.util.find_spec("jax") is None:
        return Availability(
            NAME, False, reason="jax is not installed; pip install 'enginekit[jax]'"
        )
    if importlib.util.find_spec("safetensors") is None:
        return Availability(
            NAME, False, reason="safetensors is not installed; pip install 'enginekit[jax]'"
        )
    try:
        jax = _jax()
        devices = ["cpu"] if jax.devices("cpu") else []
    except Exception as exc:  # a broken jaxlib must not break `enginekit backends`
        return Availability(NAME, False, reason=f"jax cannot start: {type(exc).__name__}: {exc}")
    try:
        if jax.devices("gpu"):
            devices.append("cuda")
    except RuntimeError:
        pass  # no GPU backend in this jaxlib
    return Availability(NAME, True, jax.__version__, tuple(devices))


def supported_ops() -> list[str]:
    """The ONNX ops (default domain) the lowering handles; empty when jax is not installed."""
    try:
        from enginekit.backends.xla.ops import supported_ops as table
    except ImportError:
        return []
    return table()


def _device(device: str) -> Any:
    jax = _jax()
    kind, _, index = device.partition(":")
    platform = "gpu" if kind == "cuda" else "cpu"
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, IndexError):
        raise BackendUnavailable(f"jax has no {device!r} device here") from None


def _put(arrays: Any, device: Any) -> tuple[Any, ...]:
    """Arrays on ``device`` with their own dtypes (int64 position tables stay int64)."""
    jax = _jax()
    with jax.enable_x64(True):
        return tuple(jax.device_put(a, device) for a in arrays)


def _platform(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


# -- build ----------------------------------------------------------------------------------


def build(model: Model, config: BuildConfig, workdir: Path) -> BuildResult:
    """Lower, export with symbolic dims, measure layouts and XLA options, write the payload."""
    from enginekit.backends.xla import check, lower, program, values
    from enginekit.backends.xla import layout as lay
    from enginekit.backends.xla import precision as reduced

    jax = _jax()
    opts = _parse_options(config.options)
    precision = config.precision.value
    if precision not in PRECISIONS:
        raise BuildError(
            f"the XLA backend builds {', '.join(PRECISIONS)} engines; precision={precision} is "
            "not supported (use --backend onnxruntime or tensorrt for int8)"
        )
    proto = lower.prepare(model.proto)
    check.check(proto)
    found = values.find(proto)
    example: dict[str, np.ndarray] = {}
    specs = list(model.inputs)
    if found:
        values.check_sizes(found, values.max_sizes(model.inputs, config.profiles), model.label)
        example = values.example_values(
            model, config.profiles, config.seed, found, config.verify_example
        )
        specs = [s for s in model.inputs if s.name not in found]
    has_convs = any(n.op_type in lay.ANCHORS for n in proto.graph.node)
    layouts = [opts.layout] if opts.layout != "auto" else ["nhwc", "nchw"]
    if not has_convs:
        layouts = [layouts[0]]
    dims = program.symbolic_dims(specs, config.profiles)
    bounds = program.symbol_bounds(specs, config.profiles, dims)
    device = _device(config.device)
    platform = _platform(config.device)
    flag_sets = _flag_sets(opts.xla_flags, platform)
    try:
        candidates = _candidates(
            values.bind(proto, example) if found else proto,
            layouts, precision, specs, dims, bounds, platform, device,
        )  # fmt: skip
    except BuildError as exc:
        if not found:
            raise
        # Example values the model rejects (generated ones can be): nothing to compile or
        # tune here; programs compile at first use, verification says if the values are bad.
        log.warning("xla: no program for %s (%s)", values.describe(example), exc)
        candidates, example = {}, {}
    files = [MODEL] if found else []
    if candidates:
        trials = _tune(model, specs, config, candidates, flag_sets, device, opts)
        layout, flags_name = (
            (trials[0]["layout"], trials[0]["flags"]) if len(trials) == 1 else _winner(trials)
        )
        lowered, exported, on_device = candidates[layout]
        (workdir / PROGRAM).write_bytes(program.serialize(exported))
        _save_weights(workdir / WEIGHTS, lowered.weight_names, lowered.weights)
        files += [PROGRAM, WEIGHTS]
    else:
        trials, layout, lowered = [], layouts[0], None
        flags_name = "xla-default" if "xla-default" in flag_sets else next(iter(flag_sets))
    buckets = opts.buckets
    why_exact = "batch rows interact: padding would change results"
    if found:
        buckets, why_exact = "exact", "value inputs: one program per set of values"
    elif buckets == "pow2" and not _padding_safe(
        model, config, exported, on_device, flag_sets[flags_name], device
    ):
        log.warning("xla: the model's batch rows interact; using one program per batch size")
        buckets = "exact"
    if found:
        values.save_model(workdir / MODEL, proto)
    metadata = {
        "layout": layout,
        "layout_choice": _layout_note(opts.layout, has_convs),
        "compiler_options": dict(flag_sets[flags_name]),
        "xla_flags": flags_name,
        "tuning": trials,
        "buckets": buckets,
        "buckets_choice": "requested" if buckets == opts.buckets else why_exact,
        "symbolic_dims": dims,
        "symbolic_constraints": list(program.constraints(bounds)),
        "platform": platform,
        "jax_version": jax.__version__,
        "weight_names": list(lowered.weight_names) if lowered else [],
        "weight_layouts": list(lowered.weight_layouts) if lowered else [],
        "lowering": dict(lowered.stats) if lowered else {},
        "precision": {
            "weights_and_activations": precision,
            "float32_ops": sorted(reduced.WIDE_OPS) if precision != "fp32" else [],
            "io": "float32 inputs and outputs are cast at the program's edges",
        },
        "opset": check.opset_of(proto),
        "load_options": {"cache_dir": opts.cache_dir, "precompile": opts.precompile},
        "value_inputs": values.metadata(found, example, PROGRAM, WEIGHTS, MODEL),
    }
    # StableHLO is portable: XLA compiles for the loading host, so no ISA is required here.
    return BuildResult(
        files=tuple(files),
        metadata=metadata,
        target={"kind": "cuda" if platform == "cuda" else "cpu"},
    )


def _candidates(
    proto: Any,
    layouts: list[str],
    precision: str,
    specs: list[TensorSpec],
    dims: Any,
    bounds: Any,
    platform: str,
    device: Any,
) -> dict[str, tuple[Any, Any, Any]]:
    """Per layout: the lowered model, its exported program and its weights on the device."""
    from enginekit.backends.xla import lower, program

    candidates: dict[str, tuple[Any, Any, Any]] = {}
    for layout in layouts:
        lowered = lower.lower(proto, layout, precision=precision)
        exported = program.export(lowered.fn, lowered.weights, specs, dims, platform, bounds)
        candidates[layout] = (lowered, exported, _put(lowered.weights, device))
    return candidates


def _layout_note(requested: str, has_convs: bool) -> str:
    if not has_convs:
        return "no convolutions or pools: layout does not apply"
    if requested == "auto":
        return "measured at build time"
    return "requested" if requested != DEFAULT_LAYOUT else "default"


def _flag_sets(choice: Any, platform: str) -> dict[str, dict[str, Any]]:
    from enginekit.backends.xla.tune import FLAG_SETS

    if isinstance(choice, Mapping):
        return {"custom": {str(k): v for k, v in choice.items()}}
    if choice == "auto":
        # The candidates are XLA:CPU library switches; GPUs keep XLA's defaults.
        return dict(FLAG_SETS) if platform == "cpu" else {"xla-default": {}}
    return {choice: dict(FLAG_SETS[choice])}


def _tune(
    model: Model,
    specs: list[TensorSpec],
    config: BuildConfig,
    candidates: Mapping[str, tuple[Any, Any, Any]],
    flag_sets: Mapping[str, Mapping[str, Any]],
    device: Any,
    opts: _Options,
) -> list[dict[str, Any]]:
    """Time each (layout, flags) candidate at the first profile's opt shape (bucketed)."""
    from enginekit.backends.xla import tune
    from enginekit.backends.xla.runtime import bucket
    from enginekit.model import concrete_shapes, random_feeds

    if len(candidates) * len(flag_sets) == 1:
        layout = next(iter(candidates))
        return [{"layout": layout, "flags": next(iter(flag_sets)), "ms": None, "compile_s": None}]
    profile = config.profiles[0] if config.profiles else None
    shapes = concrete_shapes(specs, profile, "opt")
    batched = bool(model.inputs) and all(
        s.shape and isinstance(s.shape[0], str) for s in model.inputs
    )
    if batched and opts.buckets == "pow2":
        cap = min(p[n].max[0] for p in config.profiles[:1] for n in p) if config.profiles else None
        shapes = {n: (bucket(s[0], cap), *s[1:]) for n, s in shapes.items()}
    feeds = random_feeds(specs, shapes, seed=config.seed)
    arrays = [feeds[s.name] for s in specs]
    programs = {
        layout: (exported, weights) for layout, (_, exported, weights) in candidates.items()
    }
    trials = tune.measure(programs, flag_sets, arrays, device)
    log.info("xla tuning: %s", ", ".join(f"{t.layout}/{t.flags} {t.ms:.3f} ms" for t in trials))
    return [t.to_json() for t in trials]


def _batched(model: Model) -> bool:
    if not model.inputs:
        return False
    return all(s.shape and isinstance(s.shape[0], str) for s in model.inputs) and all(
        s.shape and s.shape[0] == model.inputs[0].shape[0] for s in model.outputs
    )


def _padding_safe(
    model: Model,
    config: BuildConfig,
    exported: Any,
    weights: Any,
    options: Mapping[str, Any],
    device: Any,
) -> bool:
    """Probe (at batch 4) that padding rows cannot change the real rows' outputs."""
    from enginekit.backends.xla import tune
    from enginekit.model import concrete_shapes, random_feeds

    if not _batched(model):
        return True
    if config.profiles and all(
        p[n].min[0] == p[n].max[0] for p in config.profiles for n in p
    ):  # the profiles pin the batch: the program has a fixed batch and nothing is padded
        return True
    profile = config.profiles[0] if config.profiles else None
    shapes = concrete_shapes(model.inputs, profile, "opt")
    shapes = {n: (4, *s[1:]) for n, s in shapes.items()}
    feeds = random_feeds(model.inputs, shapes, seed=config.seed)
    arrays = [feeds[s.name] for s in model.inputs]
    return tune.rows_independent(exported, weights, arrays, options, device, config.seed)


def _winner(trials: list[dict[str, Any]]) -> tuple[str, str]:
    best = min(trials, key=lambda t: t["ms"])
    return best["layout"], best["flags"]


def _save_weights(path: Path, names: tuple[str, ...], weights: tuple[np.ndarray, ...]) -> None:
    from safetensors.numpy import save_file

    # safetensors' numpy API has no bfloat16: such weights are stored as float32 (exactly) and
    # cast back on load to the type the program takes them in.
    wide = [w.astype(np.float32) if w.dtype.name == "bfloat16" else w for w in weights]
    try:
        save_file({n: np.ascontiguousarray(w) for n, w in zip(names, wide)}, str(path))
    except Exception as exc:
        raise BuildError(f"cannot write the weights as safetensors: {exc}") from None


# -- load -----------------------------------------------------------------------------------


def _load_weights(artifact: Artifact, names: list[str]) -> list[np.ndarray]:
    from safetensors.numpy import load

    try:
        tensors = load(artifact.read(WEIGHTS))
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(
            f"{artifact.path}: {WEIGHTS} is not a readable safetensors file ({exc}); rebuild it"
        ) from None
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ArtifactError(
            f"{artifact.path}: {WEIGHTS} lacks weight(s) {', '.join(missing[:5])}; rebuild it"
        )
    return [tensors[n] for n in names]


def _use_cache_dir(path: str) -> None:
    """Point JAX's persistent compilation cache at ``path`` (process-wide)."""
    jax = _jax()
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jax._src import compilation_cache

    # The cache decides once per process whether it is on; make it look again.
    compilation_cache.reset_cache()


def load(artifact: Artifact, device: str) -> Engine:
    """Deserialize the program and weights onto ``device``; compiles nothing until first use."""
    return _load(artifact, device)


def _load(artifact: Artifact, device: str) -> XlaEngine:
    from enginekit.backends.xla import program, values
    from enginekit.backends.xla.runtime import XlaEngine

    _jax()  # BackendUnavailable, with what to install, before reading anything
    manifest = artifact.manifest
    meta = manifest.get("backend", {}).get("metadata", {})
    if "weight_names" not in meta or "compiler_options" not in meta:
        raise ArtifactError(f"{artifact.path}: the manifest lacks the XLA backend's metadata")
    options = _parse_options(manifest.get("config", {}).get("options", {}))
    if meta.get("platform", "cpu") != _platform(device):
        raise ArtifactError(
            f"{artifact.path}: built for {meta.get('platform')}, asked to load on {device}; "
            f"rebuild with --device {device}"
        )
    target = _device(device)
    specializer, build_values = values.load_specializer(
        artifact, meta, lambda w: _put([w], target)[0]
    )
    exported, weights = None, []
    if PROGRAM in artifact.manifest.get("payload", {}):
        exported = program.deserialize(artifact.read(PROGRAM))
        stored = _load_weights(artifact, list(meta["weight_names"]))
        takes = [a.dtype for a in exported.in_avals[: len(stored)]]
        weights = list(
            _put([w.astype(t) if w.dtype != t else w for w, t in zip(stored, takes)], target)
        )
    if options.cache_dir:
        _use_cache_dir(options.cache_dir)
    engine = XlaEngine(
        exported,
        weights,
        manifest,
        meta["compiler_options"],
        meta.get("buckets", "exact"),
        target,
        specializer,
        build_values,
    )
    if options.precompile:
        engine.warm(_precompile_sizes(engine, options.precompile))
    return engine


def _precompile_sizes(engine: Any, choice: Any) -> list[int]:
    if choice != "buckets":
        return list(choice)
    top = engine._max_batch or 1
    sizes = []
    size = 1
    while size < top:
        sizes.append(size)
        size *= 2
    return [*sizes, top]


# -- inspect --------------------------------------------------------------------------------


def inspect(artifact: Artifact, ir: bool = False) -> dict[str, Any]:
    """What the artifact holds; with ``ir``, also the compiled program's HLO: fusions, convs...

    ``ir=True`` compiles once, at the first profile's opt shape, with the engine's options.
    """
    meta = dict(artifact.manifest.get("backend", {}).get("metadata", {}))
    info: dict[str, Any] = {
        "layout": meta.get("layout"),
        "xla_flags": meta.get("xla_flags"),
        "compiler_options": meta.get("compiler_options"),
        "buckets": meta.get("buckets"),
        "symbolic_dims": meta.get("symbolic_dims"),
        "value_inputs": (meta.get("value_inputs") or {}).get("inputs"),
        "weights": len(meta.get("weight_names", [])),
        "lowering": meta.get("lowering"),
        "tuning": meta.get("tuning"),
        "payload_bytes": {
            n: e.get("size") for n, e in artifact.manifest.get("payload", {}).items()
        },
    }
    if ir:
        info["ir"] = _inspect_ir(artifact)
    return info


def _inspect_ir(artifact: Artifact) -> dict[str, Any]:
    import re

    from enginekit.backends.xla import program
    from enginekit.model import concrete_shapes

    manifest = artifact.manifest
    engine = _load(artifact, manifest.get("config", {}).get("device", "cpu"))
    try:
        if engine.exported is None:
            return {"note": "no program was compiled at build (value inputs whose example "
                    "values did not lower); each set of values compiles its own at first use"}  # fmt: skip
        profile = engine.profiles[0] if engine.profiles else None
        shapes = concrete_shapes(engine.inputs, profile, "opt")
        compiled = engine.executable([shapes[n] for n in engine.program_inputs])
        summary = program.hlo_summary(compiled)
        text = engine.exported.mlir_module()
        ops: dict[str, int] = {}
        for name in re.findall(r"\bstablehlo\.(\w+)", text):
            ops[name] = ops.get(name, 0) + 1
        summary["stablehlo_ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
        summary["shapes"] = {n: list(s) for n, s in shapes.items()}
        return summary
    finally:
        engine.close()


# -- profile -----------------------------------------------------------------------------------


def profile(artifact: Artifact, feeds: dict[str, Any], runs: int, warmup: int) -> list[Any]:
    """Per-HLO-op times from the JAX profiler's XLA thunk events, FLOPs from the optimized
    HLO (:mod:`.profiler`)."""
    from enginekit.backends.xla import profiler

    engine = _load(artifact, "cpu")
    try:
        return profiler.profile(engine, feeds, runs, warmup)
    finally:
        engine.close()
