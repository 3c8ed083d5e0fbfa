"""OpenVINO backend: ONNX read by OpenVINO's frontend, the profiles' dims set as bounded dynamic
dims, compiled for the CPU plugin with an explicit inference precision, exported into the artifact.

Payload: ``compiled.blob`` (``CompiledModel.export_model``: the plugin's compiled graph, loads in
milliseconds) and ``model.xml`` + ``model.bin`` (the OpenVINO IR, float32 weights), the fallback
compiled on load when the blob cannot be used: another OpenVINO version or a CPU with other ISA
flags than the build host's. The manifest records which version and flags the blob was made for.

Precisions: fp32 (``INFERENCE_PRECISION_HINT=f32``: OpenVINO's own default on a CPU with bf16
is bf16), bf16 and fp16 through the same hint, refused where the CPU would run them in another
precision, and int8 from enginekit's Q/DQ model (OpenVINO's low-precision transformations turn
Q/DQ pairs into int8 kernels; the rest of the graph runs in f32, or in bf16 with the option
``int8_float_precision=bf16`` on a CPU with native bf16: measured on MobileNetV2 with 48 of 64
layers kept float, 1.9x faster than f32 there at 2.5 points less top-1 agreement;
docs/calibration.md).

This module imports openvino only inside functions: ``import enginekit`` never pays for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginekit import target
from enginekit.backends import Availability, BuildResult
from enginekit.backends.openvino import marks
from enginekit.errors import ArtifactError, BackendUnavailable, BuildError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.backends.openvino.runtime import OvEngine
    from enginekit.config import BuildConfig, ShapeProfile
    from enginekit.model import Model

log = logging.getLogger(__name__)

NAME = "openvino"
BLOB = "compiled.blob"
IR_XML = "model.xml"
IR_BIN = "model.bin"
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
#: The distribution `enginekit backends` reads the version from without importing openvino.
PACKAGES = ("openvino",)

OPTIONS = {
    "performance_hint": "latency (default: one stream, all cores on one request) or throughput "
    "(several streams, for many requests in flight: infer_async, threads, a Batcher)",
    "streams": "CPU streams (requests run in parallel): 'auto' (default: the hint's choice) or "
    "a positive integer",
    "threads": "inference threads in all (0 = default: one per core)",
    "export": "payload: 'compiled' (default: the exported compiled model, IR as fallback) or "
    "'ir' (the IR only, compiled on every load)",
    "int8_float_precision": "what an int8 build's float part (layers without Q/DQ, the layers "
    "accuracy-aware int8 keeps out of int8) computes in: 'f32' (default) or 'bf16' (CPUs with "
    "native bf16 only: faster, less accurate)",
    "f32_layers": "ONNX node names (a list, or one comma-separated string) kept in f32 where the "
    "rest computes in bf16 (precision='bf16', or int8 with int8_float_precision=bf16): the few "
    "layers bf16 costs most accuracy in; layers an int8 plan quantizes stay int8",
}

#: What ``ek.load`` may set instead of the build options (enginekit.backends.LOAD_OPTIONS).
LOAD_OPTIONS = {"threads": "threads"}

_HINTS = ("latency", "throughput")
_EXPORTS = ("compiled", "ir")
_INT8_FLOAT = ("f32", "bf16")
#: ISA flags under which the CPU plugin computes in each reduced float type (else it falls back).
_ISA = {
    "bf16": ("avx512_bf16", "amx_bf16", "bf16"),
    "fp16": ("avx512_fp16", "amx_fp16", "asimdhp"),
}
_OV_TYPES = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32"}


def _ov() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise BackendUnavailable(
            f"openvino is not importable ({exc}); pip install 'enginekit[openvino]'"
        ) from None
    return openvino


def available() -> Availability:
    """OpenVINO's version and devices (its CPU plugin; other plugins are not used yet)."""
    try:
        ov = _ov()
        devices = ov.Core().available_devices
    except BackendUnavailable as exc:
        return Availability(NAME, False, reason=str(exc))
    if "CPU" not in devices:
        return Availability(NAME, False, version(), reason=f"no CPU plugin (devices: {devices})")
    return Availability(NAME, True, version(), ("cpu",))


def version() -> str:
    """OpenVINO's full build version (what a compiled blob is tied to)."""
    return str(_ov().get_version())


# -- options -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """The backend options, validated."""

    performance_hint: str = "latency"
    streams: int | None = None
    threads: int = 0
    export: str = "compiled"
    int8_float_precision: str = "f32"
    f32_layers: tuple[str, ...] = ()


def _choice(option: str, value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).lower()
    if text not in choices:
        close = difflib.get_close_matches(text, choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BuildError(
            f"openvino option {option}={value!r}: expected one of {', '.join(choices)}{hint}"
        )
    return text


def _count(option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BuildError(
            f"openvino option {option}={value!r}: expected an integer >= {minimum}"
            + (" or 'auto'" if option == "streams" else "")
        )
    return value


def parse_options(options: Mapping[str, Any]) -> Options:
    """Validate the backend options (names are checked by the registry).

    Raises:
        BuildError: a value out of range, with the closest valid choice for a typo.
    """
    streams = options.get("streams", "auto")
    return Options(
        performance_hint=_choice(
            "performance_hint", options.get("performance_hint", "latency"), _HINTS
        ),
        streams=None if streams == "auto" else _count("streams", streams, 1),
        threads=_count("threads", options.get("threads", 0), 0),
        export=_choice("export", options.get("export", "compiled"), _EXPORTS),
        int8_float_precision=_choice(
            "int8_float_precision", options.get("int8_float_precision", "f32"), _INT8_FLOAT
        ),
        f32_layers=marks.parse_layers(options.get("f32_layers", ())),
    )


def _float_precision(opts: Options, precision: str) -> str:
    """The enginekit precision the build's float arithmetic runs in (int8: its float part)."""
    if precision == "int8":
        return "bf16" if opts.int8_float_precision == "bf16" else "fp32"
    return precision


def _precision_support(precision: str, opts: Options | None = None) -> str | None:
    """Why this host cannot compute in ``precision`` (None: it can)."""
    what = precision
    if opts is not None and _float_precision(opts, precision) != precision:
        what = f"int8 with int8_float_precision={opts.int8_float_precision}"
        precision = _float_precision(opts, precision)
    if precision not in _ISA:
        return None
    flags = target.cpu_flags()
    if not set(_ISA[precision]) & flags:
        return (
            f"{what} on OpenVINO's CPU plugin needs one of the ISA flags "
            f"{', '.join(_ISA[precision])}; this CPU has {', '.join(sorted(flags)) or 'none'} "
            "(OpenVINO would silently compute in another precision). Build fp32 or int8 here, "
            f"or build {precision} on a host with those flags"
        )
    return None


def _compile_config(opts: Options, precision: str, profiling: bool = False) -> dict[str, Any]:
    ov = _ov()
    import openvino.properties as props
    import openvino.properties.hint as hints

    mode = hints.PerformanceMode.LATENCY
    if opts.performance_hint == "throughput":
        mode = hints.PerformanceMode.THROUGHPUT
    config: dict[str, Any] = {
        hints.performance_mode: mode,
        hints.inference_precision: getattr(ov.Type, _OV_TYPES[_float_precision(opts, precision)]),
        hints.execution_mode: hints.ExecutionMode.PERFORMANCE,
    }
    if opts.streams is not None:
        config[props.num_streams] = opts.streams
    if opts.threads:
        config[props.inference_num_threads] = opts.threads
    if profiling:
        config[props.enable_profiling] = True
    return config


# -- build -------------------------------------------------------------------------------------


def _bounds(profiles: tuple[dict[str, ShapeProfile], ...]) -> dict[str, list[tuple[int, int]]]:
    """Per input, per dim, the (min, max) over every profile: OpenVINO takes one range a dim."""
    out: dict[str, list[tuple[int, int]]] = {}
    for profile in profiles:
        for name, p in profile.items():
            dims = list(zip(p.min, p.max))
            if name in out:
                dims = [(min(a, c), max(b, d)) for (a, b), (c, d) in zip(out[name], dims)]
            out[name] = dims
    return out


def read_model(model_bytes: bytes, profiles: tuple[dict[str, ShapeProfile], ...]) -> Any:
    """The ONNX model as an ``ov.Model``, its profiled dims bounded (others as the model has)."""
    ov = _ov()
    core = ov.Core()
    try:
        model = core.read_model(model_bytes)
    except Exception as exc:
        raise BuildError(f"OpenVINO cannot read the ONNX model: {exc}") from None
    bounds = _bounds(profiles)
    if bounds:
        shapes = {}
        for port in model.inputs:
            name = port.get_any_name()
            if name in bounds:
                shapes[name] = ov.PartialShape(
                    [
                        ov.Dimension(lo) if lo == hi else ov.Dimension(lo, hi)
                        for lo, hi in bounds[name]
                    ]
                )
        try:
            model.reshape(shapes)
        except Exception as exc:
            raise BuildError(
                f"OpenVINO cannot set the profiles' shapes {shapes}: {exc}. Check --shapes "
                "against the model's inputs"
            ) from None
    return model


def build(model: Model, config: BuildConfig, workdir: Path) -> BuildResult:
    """Read, reshape and compile the model; write the compiled blob and the IR.

    The work runs in a fresh process (``blob.py``): OpenVINO names the nodes it creates from
    process-wide counters, so only a fresh process writes the same IR and blob bytes for the
    same model and options (reproducible builds: same payload checksums).
    """
    import json
    import os
    import subprocess
    import sys

    opts = parse_options(config.options)
    precision = config.precision.value
    if opts.int8_float_precision != "f32" and precision != "int8":
        raise BuildError(
            f"openvino option int8_float_precision={opts.int8_float_precision} applies to int8 "
            f"builds; this build is {precision}: drop the option (or build precision='int8')"
        )
    if opts.f32_layers and _float_precision(opts, precision) != "bf16":
        raise BuildError(
            f"openvino option f32_layers keeps layers in f32 where the rest computes in bf16; "
            f"this {precision} build computes its float part in f32 already: drop the option, "
            "or build precision='bf16' (or int8 with int8_float_precision=bf16)"
        )
    why = _precision_support(precision, opts)
    if why:
        raise BuildError(why)
    source = workdir / "source.onnx"
    source.write_bytes(model.to_bytes())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "enginekit.backends.openvino.blob", str(source), str(workdir),
             json.dumps(config.to_json(), default=str)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
    finally:
        source.unlink(missing_ok=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no message"]
        message = next((ln for ln in reversed(lines) if ln.startswith("BuildError: ")), lines[-1])
        raise BuildError(message.removeprefix("BuildError: "))
    metadata = json.loads(done.stdout.strip().splitlines()[-1])
    files = (IR_XML, IR_BIN) if opts.export == "ir" else (BLOB, IR_XML, IR_BIN)
    return BuildResult(
        files=files,
        metadata={
            "openvino_version": version(),
            **metadata,
            "performance_hint": opts.performance_hint,
            "blob": {"cpu_flags": sorted(target.cpu_flags())}
            if opts.export == "compiled"
            else None,
        },
        # The IR runs on any CPU OpenVINO supports; bf16/fp16 need one of their ISA flags,
        # checked on load (the blob's own flags are checked there too, with the IR as fallback).
        target={
            "kind": "cpu",
            "requires": [],
            "requires_any": list(_ISA.get(_float_precision(opts, precision), ())),
        },
    )


def compile_to(source: Path, config: BuildConfig, workdir: Path) -> dict[str, Any]:
    """What ``build``'s fresh process does: ONNX -> bounded ov.Model -> IR, compiled (and
    exported unless ``export='ir'``); returns the compiled model's facts for the manifest."""
    import io as _io

    ov = _ov()
    opts = parse_options(config.options)
    precision = config.precision.value
    ov_model = read_model(source.read_bytes(), config.profiles)
    ov.save_model(ov_model, str(workdir / IR_XML), compress_to_fp16=False)
    kept = {}
    if opts.f32_layers:
        names, quantized = marks.ops_to_mark(ov_model, opts.f32_layers)
        kept = {
            "layers": list(opts.f32_layers),
            "quantized": quantized,
            "ops_marked": marks.mark_ir(workdir / IR_XML, names),
        }
    core = ov.Core()
    try:
        compiled = core.compile_model(
            core.read_model(str(workdir / IR_XML), str(workdir / IR_BIN)), "CPU",
            _compile_config(opts, precision),
        )  # fmt: skip
    except Exception as exc:
        raise BuildError(f"OpenVINO cannot compile the model for CPU: {exc}") from None
    effective = _type_name(str(compiled.get_property("INFERENCE_PRECISION_HINT")))
    expected = _OV_TYPES[_float_precision(opts, precision)]
    if effective != expected:
        raise BuildError(
            f"OpenVINO computes this {precision} build in {effective} on this CPU: "
            f"{precision} is not native here. Build fp32, or bf16 where the CPU has it"
        )
    if opts.export == "compiled":
        stream = _io.BytesIO()
        compiled.export_model(stream)
        (workdir / BLOB).write_bytes(stream.getvalue())
    return {
        "inference_precision": effective,
        "streams": int(compiled.get_property("NUM_STREAMS")),
        "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
        "optimal_requests": int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")),
        **({"f32_layers": kept} if kept else {}),
    }


def _type_name(ov_type: str) -> str:
    """OpenVINO type names as the hint takes them ('<Type: 'float32'>' -> 'f32')."""
    text = ov_type.lower()
    for long, short in (("bfloat16", "bf16"), ("float16", "f16"), ("float32", "f32")):
        if long in text:
            return short
    return text


# -- load --------------------------------------------------------------------------------------


def blob_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why the artifact's compiled blob cannot be used here (None: it can)."""
    meta = manifest.get("backend", {}).get("metadata", {})
    blob = meta.get("blob")
    if not blob:
        return "the artifact has no compiled blob (export='ir')"
    built, here = meta.get("openvino_version"), version()
    if built != here:
        return f"it was compiled by OpenVINO {built}, this is {here}"
    flags = set(blob.get("cpu_flags", ()))
    if flags != set(target.cpu_flags()):
        lacking = sorted(flags - target.cpu_flags())
        extra = sorted(target.cpu_flags() - flags)
        return (
            "it was compiled for a CPU with other ISA flags"
            + (f" (this CPU lacks {', '.join(lacking)})" if lacking else "")
            + (f" (this CPU adds {', '.join(extra)})" if extra else "")
        )
    return None


def load(
    artifact: Artifact, device: str, profiling: bool = False, threads: int | None = None
) -> OvEngine:
    """Import the compiled blob when it was made for this OpenVINO and CPU, else compile the IR.

    Args:
        profiling: compile with per-node performance counters on (``enginekit profile``).
        threads: inference threads instead of the build's ``threads`` option (a compile
            property, also honoured when the blob is imported).
    """
    from enginekit.backends.openvino.runtime import OvEngine
    from enginekit.config import BuildConfig

    ov = _ov()
    manifest = artifact.manifest
    config = BuildConfig.from_json(manifest["config"])
    opts = parse_options(config.options)
    if threads is not None:
        opts = dataclasses.replace(opts, threads=threads)
    precision = config.precision.value
    why = _precision_support(precision, opts)
    if why:
        raise ArtifactError(f"{artifact.path}: {why}")
    ov_config = _compile_config(opts, precision, profiling)
    core = ov.Core()
    problem = blob_problem(manifest)
    compiled = None
    if problem is None and not profiling:
        try:
            compiled = core.import_model(artifact.read(BLOB), "CPU", ov_config)
        except ArtifactError:
            raise
        except Exception as exc:
            problem = f"OpenVINO refused it: {exc}"
    if compiled is None:
        if not profiling:
            log.info(
                "openvino: compiling the IR on load: the compiled blob is unusable (%s)", problem
            )
        try:
            ov_model = core.read_model(str(artifact.file(IR_XML)), str(artifact.file(IR_BIN)))
            compiled = core.compile_model(ov_model, "CPU", ov_config)
        except ArtifactError:
            raise
        except Exception as exc:
            raise ArtifactError(
                f"{artifact.path}: OpenVINO cannot compile the artifact's IR: {exc}. Rebuild it "
                "from the source model"
            ) from None
    return OvEngine(compiled, manifest, compiled_from="blob" if problem is None else "ir")


def inspect(artifact: Artifact, ir: bool = False) -> dict[str, Any]:
    """What the artifact holds and whether its compiled blob can be used on this host
    (``ir``: also the op types of the IR, counted)."""
    meta = artifact.manifest.get("backend", {}).get("metadata", {})
    problem = blob_problem(artifact.manifest)
    info: dict[str, Any] = {
        "inference_precision": meta.get("inference_precision"),
        "openvino_version": meta.get("openvino_version"),
        "blob_usable_here": problem is None,
        "blob_problem": problem,
    }
    if ir:
        import collections

        ov_model = _ov().Core().read_model(str(artifact.file(IR_XML)), str(artifact.file(IR_BIN)))
        info["ir_ops"] = dict(
            collections.Counter(op.get_type_name() for op in ov_model.get_ordered_ops())
        )
    return info


def qdq_options(config: BuildConfig) -> dict[str, Any]:
    """Q/DQ layout for int8: uint8 activations, per-channel int8 weights (what OpenVINO's
    low-precision transformations match); 7-bit weights on CPUs without VNNI/AMX, where the
    u8*s8 kernels saturate their int16 sums (measured on MobileNetV2, AVX2: top-1 agreement
    with fp32 65% with 8-bit weights, 80% with 7-bit; docs/calibration.md)."""
    vnni = {"avx512_vnni", "avx_vnni", "amx_int8"} & target.cpu_flags()
    return {"style": "onnxruntime-cpu", "per_channel": True, "reduce_range": not vnni}


def plan_runner(config: BuildConfig) -> Any:
    """How accuracy-aware int8 measures a plan here: the Q/DQ model compiled by this CPU
    plugin as an int8 build would be (OpenVINO's int8 kernels do not round or saturate
    like ONNX Runtime's), its float part in the ``int8_float_precision`` the build uses."""
    opts = parse_options(config.options)

    def runner(proto: Any) -> Any:
        ov = _ov()
        core = ov.Core()
        ov_model = core.read_model(proto.SerializeToString())
        if opts.f32_layers:  # the plan as the build compiles it: through the marked IR
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                xml = Path(tmp) / IR_XML
                ov.save_model(ov_model, str(xml), compress_to_fp16=False)
                marks.mark_ir(xml, marks.ops_to_mark(ov_model, opts.f32_layers)[0])
                ov_model = core.read_model(str(xml), str(Path(tmp) / IR_BIN))
                compiled = core.compile_model(ov_model, "CPU", _compile_config(opts, "int8"))
        else:
            compiled = core.compile_model(ov_model, "CPU", _compile_config(opts, "int8"))
        request = compiled.create_infer_request()
        names = [o.get_any_name() for o in compiled.outputs]

        def run(feeds: Mapping[str, Any]) -> list[Any]:
            out = request.infer(dict(feeds))
            return [out[compiled.output(n)].copy() for n in names]

        return run

    return runner


# -- profile -----------------------------------------------------------------------------------


def profile(artifact: Artifact, feeds: dict[str, Any], runs: int, warmup: int) -> list[Any]:
    """Per-node times from OpenVINO's performance counters (``PERF_COUNT``) on the artifact
    compiled with them on; FLOPs from the runtime graph's shapes of the last run."""
    from enginekit.backends.profiling import OpEvent, flops

    engine = load(artifact, "cpu", profiling=True)
    try:
        request = engine.compiled.create_infer_request()
        tensors = engine._tensors(feeds)
        for _ in range(warmup):
            request.infer(tensors)
        per_run = []
        for _ in range(runs):
            request.infer(tensors)
            per_run.append(
                [
                    (p.node_name, p.node_type, p.exec_type, p.real_time.total_seconds() * 1e6)
                    for p in request.profiling_info
                    if str(p.status).endswith("EXECUTED") and "NOT_RUN" not in str(p.status)
                ]
            )
        shapes = _runtime_shapes(engine.compiled)
    finally:
        engine.close()
    events = []
    for run, records in enumerate(per_run):
        for name, op, kernel, us in records:
            ins, out = shapes.get(name, ((), None))
            events.append(OpEvent(name, op, kernel, run, us, None, flops(op, ins, out)))
    return events


def _runtime_shapes(compiled: Any) -> dict[str, tuple[list[list[int]], list[int] | None]]:
    """Node name -> (input shapes, first output shape), where static in the runtime graph."""
    out = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        try:
            ins = [
                list(op.input(i).get_partial_shape().to_shape()) for i in range(op.get_input_size())
            ]
            first = (
                list(op.output(0).get_partial_shape().to_shape()) if op.get_output_size() else None
            )
        except Exception:  # a dynamic dim: no FLOP count for this node
            continue
        out[op.get_friendly_name()] = (ins, first)
    return out
