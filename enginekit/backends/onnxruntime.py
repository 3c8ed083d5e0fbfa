"""ONNX Runtime backend: the graph optimized once at build time and saved as the payload;
sessions on CPU, CUDA or TensorRT execution providers; an IO-binding path for devices.
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import threading
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit import target
from enginekit.backends import Availability, BuildResult
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import BackendUnavailable, BuildError
from enginekit.quiet import ort_severity, quiet_onnxruntime

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.config import BuildConfig
    from enginekit.model import Model

log = logging.getLogger(__name__)

NAME = "onnxruntime"
PAYLOAD = "model.onnx"
#: Precisions this backend builds (the convention is in enginekit/calibration/plan.py). int8
#: builds from the Q/DQ model enginekit writes; fp16/bf16 from a converted model; bf16 needs
#: CUDA (ONNX Runtime's CPU provider has no bf16 kernels).
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
DEVICE_PRECISIONS = {"cpu": ("fp32", "fp16", "int8")}

OPTIONS = {
    "optimization_level": "graph optimizations applied at build time: disable, basic, extended, "
    "all (default; 'all' adds CPU-specific layouts, so the artifact needs this CPU's ISA)",
    "intra_op_threads": "threads inside one operator (0 = ONNX Runtime's default, one per core)",
    "inter_op_threads": "threads across operators in parallel execution mode (0 = default)",
    "execution_mode": "sequential (default) or parallel",
    "allow_spinning": "intra-op threads spin while waiting for work: true (ORT's default: lowest "
    "latency) or false (they sleep: leaves the cores to readers and writers in a dataset job)",
    "providers": "execution providers in order, e.g. ['tensorrt', 'cuda', 'cpu'] "
    "(default: ['cpu'] on cpu, ['cuda', 'cpu'] on cuda)",
    "io_binding": "bind inputs and outputs through IOBinding: true, false, or null (default: on "
    "for CUDA/TensorRT providers, where it avoids copies; off on CPU, where it measured slower)",
    "int8_style": "Q/DQ layout for int8: auto (default: onnxruntime-cpu on CPU, tensorrt with "
    "GPU providers), onnxruntime-cpu (uint8 activations, fastest on CPU) or tensorrt (int8, "
    "zero points 0, float biases)",
    "int8_per_channel": "per-channel int8 weight scales (default true)",
    "int8_reduce_range": "7-bit int8 weights: auto (default: on for CPUs without VNNI, where "
    "uint8 x int8 products can saturate), true or false",
    "keep_io_types": "fp16/bf16: keep inputs and outputs float32 (default true)",
    "transformer_fusions": "fp32 on CPU: ONNX Runtime's transformer optimizer (Attention, "
    "SkipLayerNormalization, BiasGelu, ...): auto (default: on encoder/decoder graphs, kept where "
    "measured faster at the opt shapes), bert or gpt2 (force that model type), off",
    "trt_options": "TensorRT provider: extra raw provider options (dict) over the generated "
    "profile, precision and engine-cache options",
}

#: What ``ek.load`` may set instead of the build options (enginekit.backends.LOAD_OPTIONS).
LOAD_OPTIONS = {"threads": "intra_op_threads", "spinning": "allow_spinning"}

_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
}
_LEVELS = ("disable", "basic", "extended", "all")


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(
            f"onnxruntime is not importable ({exc}); pip install onnxruntime (or onnxruntime-gpu)"
        ) from None
    return onnxruntime


def available() -> Availability:
    """ONNX Runtime's version and devices; CUDA only where a GPU is really visible."""
    try:
        ort = _ort()
    except BackendUnavailable as exc:
        return Availability(NAME, False, reason=str(exc))
    devices = ["cpu"]
    provs = ort.get_available_providers()
    # onnxruntime-gpu lists CUDA even without a GPU, then silently runs on CPU: ask the driver.
    if "CUDAExecutionProvider" in provs and _cuda_device_count() > 0:
        devices.append("cuda")
    return Availability(NAME, True, ort.__version__, tuple(devices))


def _cuda_device_count() -> int:
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _providers(options: dict[str, Any], device: str) -> list[str]:
    names = options.get("providers") or (["cuda", "cpu"] if device.startswith("cuda") else ["cpu"])
    out = []
    for n in names:
        if n not in _PROVIDERS:
            raise BuildError(f"provider {n!r} is not one of {', '.join(_PROVIDERS)}")
        out.append(_PROVIDERS[n])
    if "CPUExecutionProvider" not in out:
        out.append("CPUExecutionProvider")
    return out


def _provider_options(
    providers: list[str], device: str, trt: dict[str, str] | None = None
) -> list[dict[str, str]]:
    index = device.partition(":")[2] or "0"
    out: list[dict[str, str]] = []
    for p in providers:
        if p == "TensorrtExecutionProvider" and trt is not None:
            out.append(trt)
        elif p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            out.append({"device_id": index})
        else:
            out.append({})
    return out


def _trt_options(
    inputs: list[TensorSpec], config: BuildConfig, cache_dir: Path, device: str
) -> dict[str, str]:
    """TensorRT EP options: explicit profiles, precision and the engine cache directory."""
    from enginekit.backends.tensorrt import ortep

    return ortep.provider_options(
        inputs,
        config.profiles,
        config.precision,
        str(cache_dir),
        int(device.partition(":")[2] or 0),
        config.options.get("trt_options"),
    )


def _session_options(options: dict[str, Any], level: str) -> Any:
    ort = _ort()
    so = ort.SessionOptions()
    quiet_onnxruntime()
    so.log_severity_level = ort_severity()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    so.intra_op_num_threads = int(options.get("intra_op_threads", 0))
    so.inter_op_num_threads = int(options.get("inter_op_threads", 0))
    mode = options.get("execution_mode", "sequential")
    if mode not in ("sequential", "parallel"):
        raise BuildError(f"execution_mode {mode!r}: expected 'sequential' or 'parallel'")
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if mode == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    spin = options.get("allow_spinning", True)
    if not isinstance(spin, bool):
        raise BuildError(f"allow_spinning {spin!r}: expected true or false")
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def qdq_options(config: BuildConfig) -> dict[str, Any]:
    """Keyword arguments of ``write_qdq`` for an int8 build (see OPTIONS)."""
    options = dict(config.options)
    gpu = any(p != "CPUExecutionProvider" for p in _providers(options, config.device))
    style = options.get("int8_style", "auto")
    if style == "auto":
        style = "tensorrt" if gpu else "onnxruntime-cpu"
    if style not in ("onnxruntime-cpu", "tensorrt"):
        raise BuildError(f"int8_style {style!r}: expected auto, onnxruntime-cpu or tensorrt")
    reduce_range = options.get("int8_reduce_range", "auto")
    if reduce_range == "auto":
        vnni = {"avx512_vnni", "avx_vnni", "asimd"} & target.cpu_flags()
        reduce_range = style == "onnxruntime-cpu" and not vnni
    return {
        "style": style,
        "per_channel": bool(options.get("int8_per_channel", True)),
        "reduce_range": bool(reduce_range),
    }


def _convert(model: Model, config: BuildConfig) -> bytes:
    """The model bytes in the build's precision (fp16/bf16 converted; int8 is Q/DQ already)."""
    keep_io = bool(config.options.get("keep_io_types", True))
    if config.precision.value == "fp16":
        from enginekit.calibration.convert import to_fp16

        return to_fp16(model.proto, keep_io).SerializeToString()
    if config.precision.value == "bf16":
        if not config.device.startswith("cuda"):
            raise BuildError(
                "bf16 on ONNX Runtime needs device='cuda': its CPU provider has no bf16 kernels "
                "(MatMul, Gemm, Add, Relu: NOT_IMPLEMENTED in 1.32). On CPU use fp32 or int8"
            )
        from enginekit.calibration.convert import to_bf16

        return to_bf16(model.proto, keep_io).SerializeToString()
    return model.to_bytes()


def build(model: Model, config: BuildConfig, workdir: Path) -> BuildResult:
    """Optimize the graph once for the target providers and save it as the payload."""
    ort = _ort()
    options = dict(config.options)
    level = options.get("optimization_level", "all")
    if level not in _LEVELS:
        raise BuildError(f"optimization_level {level!r}: expected one of {', '.join(_LEVELS)}")
    providers = _providers(options, config.device)
    if "TensorrtExecutionProvider" in providers:
        return _build_trt(model, config, workdir, providers, level)
    so = _session_options(options, level)
    out = workdir / PAYLOAD
    so.optimized_model_filepath = str(out)
    data = _convert(model, config)
    passes = []
    if config.precision.value == "fp32" and providers == ["CPUExecutionProvider"]:
        data, record = _transformer_fusions(model, config, options, level, providers)
        passes = [record.to_json()] if record is not None else []
    try:
        ort.InferenceSession(
            data, so, providers=providers,
            provider_options=_provider_options(providers, config.device),
        )  # fmt: skip
    except Exception as exc:
        raise BuildError(f"ONNX Runtime cannot build the model: {exc}") from None
    requires = sorted(target.cpu_flags()) if level == "all" else []
    return BuildResult(
        files=(PAYLOAD,),
        metadata={"optimization_level": level, "providers": providers, "passes": passes},
        target={"kind": "cpu" if config.device == "cpu" else "cuda", "requires": requires},
    )


def _transformer_fusions(
    model: Model, config: BuildConfig, options: dict[str, Any], level: str, providers: list[str]
) -> tuple[bytes, Any]:
    """The model bytes with ONNX Runtime's transformer fusions where they measure faster."""
    import difflib

    from enginekit.backends import ort_fusions
    from enginekit.model import concrete_shapes, random_feeds

    mode = str(options.get("transformer_fusions", "auto")).lower()
    if mode not in ort_fusions.MODES:
        close = difflib.get_close_matches(mode, ort_fusions.MODES, n=1)
        raise BuildError(
            f"transformer_fusions {mode!r}: expected one of {', '.join(ort_fusions.MODES)}"
            + (f"; did you mean {close[0]!r}?" if close else "")
        )
    try:
        profile = config.profiles[0] if config.profiles else None
        feeds = random_feeds(
            model.inputs, concrete_shapes(model.inputs, profile, "opt"), config.seed
        )
    except BuildError:
        feeds = None  # symbolic dims without a profile: nothing to time on

    def session(data: bytes) -> Any:
        return _ort().InferenceSession(data, _session_options(options, level), providers=providers)

    def session_ops(data: bytes) -> Any:
        return _optimized_op_counts(data, options, level, providers)

    return ort_fusions.choose(model.proto, mode, session, feeds, session_ops=session_ops)


def _optimized_op_counts(
    data: bytes, options: dict[str, Any], level: str, providers: list[str]
) -> collections.Counter[str]:
    """Op types, counted, of the graph a session at ``level`` makes of ``data`` (weights
    written beside it as external data: only the graph is read back)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="enginekit-ort-opt-") as tmp:
        so = _session_options(options, level)
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.data"
        )
        _ort().InferenceSession(data, so, providers=providers)
        proto = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return collections.Counter(n.op_type for n in proto.graph.node)


def _build_trt(
    model: Model, config: BuildConfig, workdir: Path, providers: list[str], level: str
) -> BuildResult:
    """TensorRT EP: save a provider-neutral graph, then let a session build the TensorRT
    engines into a cache directory whose files become payload files."""
    from enginekit.feeds import make_feeds
    from enginekit.model import concrete_shapes

    ort = _ort()
    # Above 'basic', ORT writes CPU-specific ops TensorRT cannot take; and a session with the
    # TensorRT EP cannot save its (compiled) graph at all.
    level = _LEVELS[min(_LEVELS.index(level), _LEVELS.index("basic"))]
    so = _session_options(dict(config.options), level)
    so.optimized_model_filepath = str(workdir / PAYLOAD)
    ort.InferenceSession(model.to_bytes(), so, providers=["CPUExecutionProvider"])
    cache = workdir / "trt_cache"
    cache.mkdir()
    try:
        session = ort.InferenceSession(
            (workdir / PAYLOAD).read_bytes(),
            _session_options(dict(config.options), "disable"),
            providers=providers,
            provider_options=_provider_options(
                providers,
                config.device,
                _trt_options(list(model.inputs), config, cache, config.device),
            ),
        )
    except Exception as exc:
        raise BuildError(
            f"ONNX Runtime's TensorRT provider cannot build the model: {exc}"
        ) from None
    if "TensorrtExecutionProvider" not in session.get_providers():
        raise BuildError(
            f"ONNX Runtime fell back to {session.get_providers()}: its TensorRT provider is not "
            "usable here (onnxruntime-gpu with TensorRT libraries and a GPU are needed)"
        )
    # One run per profile at its opt shapes: every engine is built and cached now, not at load.
    for profile in config.profiles or [None]:
        shapes = concrete_shapes(model.inputs, profile, "opt")
        session.run(None, make_feeds(model, shapes, config.seed))
    files = sorted(f"trt_cache/{p.name}" for p in cache.iterdir() if p.is_file())
    return BuildResult(
        files=(PAYLOAD, *files),
        metadata={"optimization_level": level, "providers": providers, "trt_cache": files},
        target={"kind": "cuda", "requires": []},
    )


def load(
    artifact: Artifact, device: str, threads: int | None = None, spinning: bool | None = None
) -> Engine:
    """A session on the optimized payload; no graph optimization happens on load.

    Args:
        threads: intra-op threads instead of the build's ``intra_op_threads`` (threading is a
            session option: the payload does not depend on it).
        spinning: instead of the build's ``allow_spinning``.
    """
    ort = _ort()
    manifest = artifact.manifest
    options = dict(manifest["config"].get("options", {}))
    if threads is not None:
        options["intra_op_threads"] = threads
    if spinning is not None:
        options["allow_spinning"] = spinning
    providers = _providers(options, device)
    so = _session_options(options, "disable")
    trt, cache = None, None
    if "TensorrtExecutionProvider" in providers:
        from enginekit.config import BuildConfig

        # The EP may rewrite its cache: give it a private copy, never the artifact's files.
        cache = Path(tempfile.mkdtemp(prefix="enginekit-trt-cache-"))
        for name in artifact.payload_names:
            if name.startswith("trt_cache/"):
                shutil.copyfile(artifact.file(name), cache / Path(name).name)
        config = BuildConfig.from_json(manifest["config"])
        trt = _trt_options(_specs(manifest["inputs"]), config, cache, device)
    session = ort.InferenceSession(
        artifact.read(PAYLOAD), so, providers=providers,
        provider_options=_provider_options(providers, device, trt),
    )  # fmt: skip
    active = session.get_providers()
    fell_back = [p for p in providers if p not in active]
    if fell_back:
        message = (
            f"ONNX Runtime fell back from {', '.join(fell_back)} to {', '.join(active)}: the "
            "requested provider is not usable here (no GPU, or its libraries are missing)"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)
    io_binding = options.get("io_binding")
    if io_binding is None:
        io_binding = any(p != "CPUExecutionProvider" for p in active)
    engine = OrtEngine(session, manifest, io_binding=bool(io_binding), device=device)
    if cache is not None:
        weakref.finalize(engine, shutil.rmtree, cache, True)
    return engine


def _specs(items: list[dict[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec.from_json(i) for i in items]


class OrtEngine(Engine):
    """An Engine over an ``onnxruntime.InferenceSession``.

    Attributes:
        session: the underlying InferenceSession.
        providers: the execution providers actually active (after any fallback).
        io_binding: whether calls go through IOBinding.
    """

    def __init__(
        self, session: Any, manifest: dict[str, Any], io_binding: bool, device: str
    ) -> None:
        from enginekit.config import BuildConfig

        config = BuildConfig.from_json(manifest["config"])
        super().__init__(
            _specs(manifest["inputs"]), _specs(manifest["outputs"]), config.profiles, manifest
        )
        self.session = session
        self.providers = session.get_providers()
        self.io_binding = io_binding
        self._out_names = [o.name for o in self.outputs]
        self._out_single = self._out_names[0] if len(self._out_names) == 1 else None
        # InferenceSession.run re-validates names and EP fallback in Python on every call
        # (~4 µs, half of a tiny model's run); Engine has validated already, so call the C++
        # session directly when this ORT build exposes it.
        self._session_run = getattr(session, "_sess", session).run
        self._device = device
        self._local = threading.local()
        if io_binding:
            self._run = self._run_bound  # type: ignore[method-assign]

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self._session_run(self._out_names, feeds, None)
        if self._out_single is not None:
            return {self._out_single: results[0]}
        return dict(zip(self._out_names, results))

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # One IOBinding per thread: bindings are mutable, the session is shared.
        local = self._local
        binding = getattr(local, "binding", None)
        if binding is None:
            binding = local.binding = self.session.io_binding()
            local.buffers = {}
        on_device = self._device.startswith("cuda")
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        key = tuple(a.shape for a in feeds.values())
        buffers = local.buffers.get(key) if on_device else None
        if buffers is None:
            for name in self._out_names:
                binding.bind_output(name, "cuda" if on_device else "cpu", self._device_id())
        else:
            # Device buffers allocated once per input-shape signature and reused.
            for name, value in buffers.items():
                binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        if on_device and buffers is None:
            local.buffers[key] = dict(zip(self._out_names, values))
        result = dict(zip(self._out_names, binding.copy_outputs_to_cpu()))
        binding.clear_binding_inputs()
        return result

    def _device_id(self) -> int:
        return int(self._device.partition(":")[2] or 0)

    def _close(self) -> None:
        self.session = None


# -- profile -----------------------------------------------------------------------------------


def profile(artifact: Artifact, feeds: dict[str, np.ndarray], runs: int, warmup: int) -> list[Any]:
    """Per-kernel times from ONNX Runtime's profiler (``enable_profiling``) on a session over
    the artifact's payload with its options; warm-up runs are recorded and dropped."""
    import json

    from enginekit.backends.profiling import OpEvent, flops

    ort = _ort()
    options = dict(artifact.manifest["config"].get("options", {}))
    providers = _providers(options, "cpu")
    if providers != ["CPUExecutionProvider"]:
        raise BuildError("profiling an ONNX Runtime engine works on its CPU provider only")
    so = _session_options(options, "disable")
    tmp = Path(tempfile.mkdtemp(prefix="enginekit-profile-"))
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "ort")
    try:
        session = ort.InferenceSession(artifact.read(PAYLOAD), so, providers=providers)
        for _ in range(warmup + runs):
            session.run(None, feeds)
        trace = json.loads(Path(session.end_profiling()).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    run_starts = sorted(
        e["ts"] for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    recorded = run_starts[warmup:]
    if len(recorded) != runs:
        raise BuildError(
            f"ONNX Runtime's profile holds {len(run_starts)} runs, expected {warmup + runs}"
        )
    origin = recorded[0]
    events = []
    for e in trace:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        ts = e["ts"]
        if ts < origin:
            continue
        run = sum(1 for s in recorded if s <= ts) - 1
        args = e.get("args", {})
        ins = [next(iter(t.values())) for t in args.get("input_type_shape", []) if t]
        outs = [next(iter(t.values())) for t in args.get("output_type_shape", []) if t]
        op = str(args.get("op_name", "?"))
        events.append(
            OpEvent(
                name=e["name"][: -len("_kernel_time")],
                op=op,
                kernel=str(args.get("provider", "CPUExecutionProvider")),
                run=run,
                dur_us=float(e["dur"]),
                start_us=float(ts - origin),
                flops=flops(op, ins, outs[0] if outs else None),
            )
        )
    return events
