"""Planning a TensorRT build: pure Python, runs and is tested without TensorRT or a GPU.

Everything that can be decided before TensorRT is imported is decided here — optimization
profiles, the precision plan (which ONNX rewrite, which builder flags for TensorRT 10 vs 11),
memory pool limits, builder options, the build key and where the timing cache lives — so that a
user learns about a mistake in seconds, not after a ten-minute build.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginekit.backends.tensorrt import precision as rewrite
from enginekit.backends.tensorrt.precision import DEFAULT_FP32_OPS
from enginekit.config import BuildConfig, Precision, ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError

if TYPE_CHECKING:
    from enginekit.model import Model

#: TensorRT major versions this backend drives; 11 removed weak typing, so it is the reference
#: for anything newer.
SUPPORTED_MAJORS = (10, 11)

#: Options that change where files go or what is checked, not the engine: left out of the key.
_NOT_IN_KEY = ("timing_cache", "check_ops")

_HARDWARE_COMPAT = ("none", "ampere_plus", "same_compute_capability")
_MEMORY_POOLS = (
    "WORKSPACE",
    "DLA_MANAGED_SRAM",
    "DLA_LOCAL_DRAM",
    "DLA_GLOBAL_DRAM",
    "TACTIC_DRAM",
    "TACTIC_SHARED_MEMORY",
)

# -- versions ----------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, ...]:
    """``"10.8.0.43"`` -> ``(10, 8, 0, 43)``; non-numeric tails (``"11.0.0rc1"``) are cut off."""
    parts = []
    for piece in str(text).split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    if not parts:
        raise BuildError(f"TensorRT version {text!r} is not a version number")
    return tuple(parts)


def generation(version: str) -> int:
    """The API generation to drive: 10 (builder precision flags exist) or 11 (strongly typed).

    Raises:
        BuildError: TensorRT older than 10.
    """
    major = parse_version(version)[0]
    if major < SUPPORTED_MAJORS[0]:
        raise BuildError(
            f"TensorRT {version} is too old: enginekit drives TensorRT 10.x and 11.x; install a "
            "newer one (docs/backends/tensorrt.md)"
        )
    return 10 if major == 10 else 11


# -- profiles ----------------------------------------------------------------------------------


def dynamic_axes(spec: TensorSpec) -> list[tuple[int, str]]:
    """(axis, symbol) of every non-fixed dim of an input; unnamed dims read as ``"?"``."""
    return [(axis, str(d)) for axis, d in enumerate(spec.shape) if not isinstance(d, int)]


def plan_profiles(
    inputs: Sequence[TensorSpec], profiles: Sequence[Mapping[str, ShapeProfile]]
) -> tuple[dict[str, ShapeProfile], ...]:
    """Check profiles against the model's inputs and complete them for TensorRT.

    Every returned profile names every input, in input order: fixed inputs left out by the user
    get their one shape. A model whose inputs are all fixed needs no profile (returns ``()``).

    Raises:
        BuildError: a profile names an unknown input, has the wrong rank, contradicts a fixed
            dim, leaves a dynamic input out, covers other inputs than profile 0, or gives two
            inputs that share a symbolic dim different ranges for it — naming input and dim.
    """
    specs = {s.name: s for s in inputs}
    dynamic = [s for s in inputs if dynamic_axes(s)]
    if not profiles:
        if dynamic:
            s = dynamic[0]
            axis, sym = dynamic_axes(s)[0]
            raise BuildError(
                f"input {s.name!r} dim {axis} is dynamic ({sym!r}): TensorRT needs its range. "
                f"Give shapes={{'{s.name}': [min, opt, max]}} (CLI: --shapes "
                f"{s.name}:{_example(s)})"
            )
        return ()
    first = set(profiles[0])
    out = []
    for i, profile in enumerate(profiles):
        for name in profile:
            if name not in specs:
                raise BuildError(
                    f"profile {i} names input {name!r}, which the model does not have (inputs: "
                    f"{', '.join(specs)})"
                )
        complete = {}
        for spec in inputs:
            if spec.name in profile:
                complete[spec.name] = _check_input(i, spec, profile[spec.name])
            elif dynamic_axes(spec):
                axis, sym = dynamic_axes(spec)[0]
                raise BuildError(
                    f"profile {i} gives no shapes for input {spec.name!r}, whose dim {axis} is "
                    f"dynamic ({sym!r}); every profile must cover every dynamic input "
                    f"(--shapes {spec.name}:{_example(spec)})"
                )
            else:
                complete[spec.name] = ShapeProfile.fixed(tuple(int(d) for d in spec.shape))
        for name in sorted(set(profile) ^ first):
            where, missing = (0, i) if name in first else (i, 0)
            raise BuildError(
                f"input {name!r} is in profile {where} but not in profile {missing}: every "
                "profile must cover the same inputs"
            )
        _check_shared_dims(i, inputs, complete)
        out.append(complete)
    return tuple(out)


def _example(spec: TensorSpec) -> str:
    def shape(n: int) -> str:
        return "x".join(str(d) if isinstance(d, int) else str(n) for d in spec.shape)

    return f"{shape(1)},{shape(8)},{shape(32)}"


def _check_input(i: int, spec: TensorSpec, prof: ShapeProfile) -> ShapeProfile:
    if len(prof.min) != len(spec.shape):
        raise BuildError(
            f"profile {i}, input {spec.name!r}: shapes of rank {len(prof.min)} {prof.min}; the "
            f"model's input is rank {len(spec.shape)} {spec.shape}"
        )
    for axis, d in enumerate(spec.shape):
        lo, mid, hi = prof.min[axis], prof.opt[axis], prof.max[axis]
        if isinstance(d, int) and not lo == mid == hi == d:
            raise BuildError(
                f"profile {i}, input {spec.name!r} dim {axis}: the model fixes it to {d}, the "
                f"profile gives min {lo}, opt {mid}, max {hi}"
            )
        if not 0 <= lo <= mid <= hi:
            raise BuildError(
                f"profile {i}, input {spec.name!r} dim {axis}: needs 0 <= min <= opt <= max, got "
                f"{lo}, {mid}, {hi}"
            )
    return prof


def _check_shared_dims(
    i: int, inputs: Sequence[TensorSpec], profile: Mapping[str, ShapeProfile]
) -> None:
    seen: dict[str, tuple[str, int, tuple[int, int, int]]] = {}
    for spec in inputs:
        for axis, sym in dynamic_axes(spec):
            if sym == "?":
                continue
            p = profile[spec.name]
            got = (p.min[axis], p.opt[axis], p.max[axis])
            if sym not in seen:
                seen[sym] = (spec.name, axis, got)
                continue
            name, first_axis, want = seen[sym]
            if got != want:
                raise BuildError(
                    f"profile {i}: inputs {name!r} dim {first_axis} and {spec.name!r} dim {axis} "
                    f"share the dynamic dim {sym!r} but get different ranges (min/opt/max "
                    f"{'/'.join(map(str, want))} vs {'/'.join(map(str, got))}); give them the "
                    "same range"
                )


def select_profile(
    profiles: Sequence[Mapping[str, ShapeProfile]], shapes: Mapping[str, Sequence[int]]
) -> int | None:
    """Index of the profile to run ``shapes`` with: among those whose ranges hold every shape,
    the one whose opt shapes are nearest (sum of absolute dim differences); ties go to the lower
    index. ``0`` when there are no profiles (a static engine's implicit one); None if none fits.
    """
    if not profiles:
        return 0
    best: tuple[int, int] | None = None
    for index, profile in enumerate(profiles):
        if not all(n in profile and profile[n].contains(s) for n, s in shapes.items()):
            continue
        distance = sum(abs(d - o) for n, s in shapes.items() for d, o in zip(s, profile[n].opt))
        if best is None or distance < best[0]:
            best = (distance, index)
    return None if best is None else best[1]


# -- sizes and options ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40})


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from an int or text: ``4096``, ``"512MiB"``, ``"4GiB"``, ``"2G"``, ``"1.5GB"``.

    Raises:
        BuildError: not a non-negative size.
    """
    if isinstance(value, bool):
        raise BuildError(f"{what}: expected bytes or text like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise BuildError(f"{what}: must be >= 0 bytes, got {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(value), re.IGNORECASE)
    if not match:
        raise BuildError(
            f"{what}: {value!r} is not a size; write bytes or a number with a unit "
            "(e.g. 4GiB, 512MiB, 2G)"
        )
    unit = (match.group(2) or "").lower()
    return int(float(match.group(1)) * _UNITS[unit])


def memory_pools(options: Mapping[str, Any]) -> dict[str, int]:
    """Memory pool limits in bytes by TensorRT ``MemoryPoolType`` name, from the ``workspace``
    shorthand and the ``memory_pools`` mapping (pool name -> size).

    Raises:
        BuildError: an unknown pool name or a bad size.
    """
    pools: dict[str, int] = {}
    raw = options.get("memory_pools") or {}
    if not isinstance(raw, Mapping):
        raise BuildError(
            f"memory_pools: expected a mapping pool -> size, e.g. {{'workspace': '4GiB'}}, got {raw!r}"
        )
    for name, size in raw.items():
        key = str(name).upper()
        if key not in _MEMORY_POOLS:
            raise BuildError(
                f"memory_pools: no TensorRT memory pool {name!r}; pools: "
                f"{', '.join(p.lower() for p in _MEMORY_POOLS)}"
            )
        pools[key] = parse_size(size, f"memory_pools[{name!r}]")
    if options.get("workspace") is not None:
        pools["WORKSPACE"] = parse_size(options["workspace"], "workspace")
    return pools


def _bool(options: Mapping[str, Any], key: str, default: bool | None) -> bool | None:
    value = options.get(key, default)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise BuildError(f"option {key}: expected true or false, got {value!r}")


# -- precision -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """How a precision is reached on one TensorRT generation.

    Attributes:
        precision: fp32, fp16, bf16 or int8.
        rewrite: the ONNX rewrite before parsing: ``none``, ``fp16``, ``bf16`` (float tensors
            converted, I/O kept fp32) or ``qdq`` (the Q/DQ model from calibration replaces it).
        strongly_typed: TensorRT takes every layer's precision from the ONNX types.
        network_flags: ``NetworkDefinitionCreationFlag`` names to set.
        builder_flags: ``BuilderFlag`` names to set (TensorRT 10's weak typing only).
        cleared_flags: ``BuilderFlag`` names to clear (TF32, on by default, unless asked for).
        fp32_ops: op types the fp16/bf16 rewrite keeps in fp32.
    """

    precision: str
    rewrite: str
    strongly_typed: bool
    network_flags: tuple[str, ...] = ()
    builder_flags: tuple[str, ...] = ()
    cleared_flags: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def plan_precision(
    precision: Precision | str,
    trt_generation: int,
    *,
    strongly_typed: bool | None = None,
    tf32: bool = False,
    model_has_qdq: bool = False,
    has_quantizer: bool = False,
    fp32_ops: Sequence[str] | None = None,
) -> PrecisionPlan:
    """Decide the ONNX rewrite and builder flags for ``precision`` on TensorRT 10 or 11.

    TensorRT 11 removed weak typing (the FP16/BF16/INT8 builder flags and the calibrators): the
    ONNX model itself must carry fp16/bf16 tensors or Q/DQ nodes, and the network is strongly
    typed. TensorRT 10 keeps the flags; enginekit uses them there by default (TensorRT then
    picks per-layer precision) unless ``strongly_typed=True`` asks for the TensorRT 11 route.

    Args:
        precision: fp32, fp16, bf16 or int8.
        trt_generation: 10 or 11 (see :func:`generation`).
        strongly_typed: None = the generation's default; False is refused on TensorRT 11.
        tf32: keep TF32 math enabled for fp32 layers (TensorRT's default; off here so that fp32
            engines meet fp32 tolerances).
        model_has_qdq: the model already holds QuantizeLinear/DequantizeLinear nodes.
        has_quantizer: a Q/DQ model will be supplied (a ``qdq_model`` or a quantize callable).
        fp32_ops: op types the fp16/bf16 rewrite keeps in fp32 (default DEFAULT_FP32_OPS).

    Raises:
        BuildError: int8 without a Q/DQ model, a Q/DQ model at another precision, or weak
            typing asked of TensorRT 11.
    """
    try:
        p = Precision(precision)
    except ValueError:
        raise BuildError(
            f"precision {precision!r} is not one of {', '.join(x.value for x in Precision)}"
        ) from None
    if trt_generation >= 11:
        if strongly_typed is False:
            raise BuildError(
                "strongly_typed=false: TensorRT 11 has no weakly typed networks (its FP16/BF16/"
                "INT8 builder flags are gone); drop the option, precision comes from the model"
            )
        typed = True
    else:
        typed = bool(strongly_typed)
    if model_has_qdq and p is not Precision.INT8:
        raise BuildError(
            f"the model holds QuantizeLinear/DequantizeLinear nodes but precision is {p.value}: "
            "build a Q/DQ model with --precision int8, or pass the float model for fp32/fp16/bf16"
        )
    if p is Precision.INT8 and not (model_has_qdq or has_quantizer):
        raise BuildError(
            "int8 on TensorRT needs a Q/DQ model: TensorRT 11 removed the implicit INT8 "
            "calibrators and 10 deprecated them, so enginekit quantizes explicitly. Calibrate "
            "(--calib-data) or pass qdq_model=<path of the Q/DQ ONNX model made from this model>"
        )
    cleared = () if tf32 else ("TF32",)
    network_flags = ("STRONGLY_TYPED",) if typed and trt_generation == 10 else ()
    low_ops = tuple(DEFAULT_FP32_OPS if fp32_ops is None else fp32_ops)
    if p is Precision.FP32:
        return PrecisionPlan(p.value, "none", typed, network_flags, (), cleared)
    if p in (Precision.FP16, Precision.BF16):
        if typed:
            return PrecisionPlan(p.value, p.value, True, network_flags, (), cleared, low_ops)
        return PrecisionPlan(p.value, "none", False, (), (p.value.upper(),), cleared)
    rewrite = "none" if model_has_qdq else "qdq"
    flags = () if typed else ("INT8",)
    return PrecisionPlan(p.value, rewrite, typed, network_flags, flags, cleared)


# -- the whole build ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything the device side needs to build, decided before TensorRT is touched.

    Attributes:
        trt_version: the TensorRT version the plan is for.
        generation: 10 or 11.
        profiles: complete profiles (every input, input order); empty for a static model.
        precision: the precision plan.
        memory_pools: pool limits in bytes by ``MemoryPoolType`` name.
        builder_optimization_level: 0-5, or None for TensorRT's default (3).
        hardware_compatibility: none, ampere_plus or same_compute_capability.
        version_compatible: build a plan later runtimes of the same major version can load.
        timing_cache: the user's timing cache path (file or directory) or None.
        check_ops: refuse ops TensorRT's ONNX parser does not support before building.
        qdq_model: path of the Q/DQ model to build instead of the source model (int8).
    """

    trt_version: str
    generation: int
    profiles: tuple[dict[str, ShapeProfile], ...]
    precision: PrecisionPlan
    memory_pools: dict[str, int]
    builder_optimization_level: int | None
    hardware_compatibility: str
    version_compatible: bool
    timing_cache: str | None
    check_ops: bool
    qdq_model: str | None

    def to_json(self) -> dict[str, Any]:
        data = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        data["profiles"] = [{k: v.to_json() for k, v in p.items()} for p in self.profiles]
        data["precision"] = self.precision.to_json()
        return data


def plan_build(
    model: Model,
    config: BuildConfig,
    trt_version: str,
    *,
    has_quantizer: bool = False,
) -> BuildPlan:
    """Validate a TensorRT build of ``model`` with ``config`` and decide how to do it.

    Raises:
        BuildError: bad profiles, options or precision, with what to change.
    """
    gen = generation(trt_version)
    options = dict(config.options)
    level = options.get("builder_optimization_level")
    if level is not None and (
        isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 5
    ):
        raise BuildError(f"builder_optimization_level: expected an integer 0-5, got {level!r}")
    compat = str(options.get("hardware_compatibility", "none")).lower()
    if compat not in _HARDWARE_COMPAT:
        raise BuildError(
            f"hardware_compatibility {compat!r}: expected one of {', '.join(_HARDWARE_COMPAT)}"
        )
    fp32_ops = options.get("fp32_ops")
    if fp32_ops is not None and (
        isinstance(fp32_ops, str) or not all(isinstance(o, str) for o in fp32_ops)
    ):
        raise BuildError(f"fp32_ops: expected a list of op types, e.g. ['Pow'], got {fp32_ops!r}")
    qdq_model = options.get("qdq_model")
    if qdq_model is not None and not Path(str(qdq_model)).is_file():
        raise BuildError(f"qdq_model: no such ONNX file {qdq_model!r}")
    timing_cache = options.get("timing_cache")
    return BuildPlan(
        trt_version=trt_version,
        generation=gen,
        profiles=plan_profiles(model.inputs, config.profiles),
        precision=plan_precision(
            config.precision,
            gen,
            strongly_typed=_bool(options, "strongly_typed", None),
            tf32=bool(_bool(options, "tf32", False)),
            model_has_qdq=rewrite.has_qdq(model.proto),
            has_quantizer=has_quantizer or qdq_model is not None,
            fp32_ops=fp32_ops,
        ),
        memory_pools=memory_pools(options),
        builder_optimization_level=level,
        hardware_compatibility=compat,
        version_compatible=bool(_bool(options, "version_compatible", False)),
        timing_cache=None if timing_cache is None else str(timing_cache),
        check_ops=bool(_bool(options, "check_ops", True)),
        qdq_model=None if qdq_model is None else str(qdq_model),
    )


# -- keys and caches -----------------------------------------------------------------------------


def build_key(
    model: Model,
    config: BuildConfig,
    trt_version: str,
    compute_capability: str,
    calibration: str | None = None,
) -> str:
    """SHA-256 of everything that decides a TensorRT engine: model bytes, config (less options
    that only move files, such as ``timing_cache``), calibration (the Q/DQ model's hash),
    TensorRT version and GPU compute capability. Same key, same engine.
    """
    from enginekit.artifact import build_key as spine_key

    options = {k: v for k, v in config.options.items() if k not in _NOT_IN_KEY}
    keyed = dataclasses.replace(config, options=options)
    return spine_key(model, keyed, f"tensorrt {trt_version} sm {compute_capability}", calibration)


def device_key(trt_version: str, gpu_name: str, compute_capability: str) -> str:
    """A file-name-safe key of a TensorRT version and a GPU: ``trt10.8.0.43-sm90-nvidia-h200``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    sm = compute_capability.replace(".", "")
    return f"trt{trt_version}-sm{sm}-{slug}"


def timing_cache_path(
    base: str | Path, trt_version: str, gpu_name: str, compute_capability: str
) -> Path:
    """Where the timing cache for this TensorRT version and GPU lives, given the user's path.

    A directory (existing, or written with a trailing slash) holds one file per key:
    ``<dir>/<key>.cache``. A file path gets the key before its suffix: ``trt.cache`` ->
    ``trt.<key>.cache``, so caches of different GPUs or versions never overwrite each other
    (TensorRT would reject a foreign one anyway).
    """
    key = device_key(trt_version, gpu_name, compute_capability)
    text = str(base)
    path = Path(text)
    if text.endswith(("/", "\\")) or path.is_dir():
        return path / f"{key}.cache"
    suffix = path.suffix or ".cache"
    return path.with_name(f"{path.stem}.{key}{suffix}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value
