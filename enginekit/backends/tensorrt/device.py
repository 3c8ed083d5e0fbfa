"""Building and running TensorRT engines: needs TensorRT and an NVIDIA GPU.

NEVER RUN: no machine this was written on had TensorRT or a GPU. It is written against the
TensorRT 10/11 Python API and Polygraphy 0.53 as documented; ``tests/gpu/run.sh`` is what checks
it on a GPU machine. The pure parts (``config_kwargs``, ``polygraphy_profiles``) are tested on CPU.

Build: Polygraphy's loaders (``NetworkFromOnnxPath`` -> ``CreateConfig`` ->
``EngineBytesFromNetwork``) — they already handle the ONNX parser's errors, optimization
profiles, memory pools, builder levels, compatibility flags and timing cache load/merge/save
across TensorRT versions. Run: enginekit's own code, because Polygraphy's ``TrtRunner`` keeps one
execution context, reallocates outputs per call and copies through pageable memory, and the
engine here wants one context per profile, buffers allocated once per shape and pinned copies.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from enginekit.backends.tensorrt import cuda
from enginekit.backends.tensorrt.plan import (
    BuildPlan,
    plan_profiles,
    select_profile,
    timing_cache_path,
)
from enginekit.config import BuildConfig, ShapeProfile
from enginekit.engine import Batch, Engine, TensorSpec
from enginekit.errors import (
    ArtifactError,
    BackendUnavailable,
    BuildError,
    EngineInputError,
    EnginekitError,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it from NVIDIA's package index: pip install --extra-index-url https://pypi.nvidia.com "
    "tensorrt (CUDA 13 builds; tensorrt-cu12 for CUDA 12), or run in an NGC container "
    "(nvcr.io/nvidia/tensorrt, nvcr.io/nvidia/pytorch); see docs/backends/tensorrt.md"
)

#: numpy dtype names of TensorRT's DataType members (bf16 needs ml_dtypes).
_NUMPY = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
}
#: Shape signatures whose buffers one execution context keeps before freeing the oldest.
MAX_CACHED_SHAPES = 16


def import_tensorrt() -> Any:
    """The ``tensorrt`` module.

    Raises:
        BackendUnavailable: not installed (or its libraries fail to load), with how to install.
    """
    try:
        import tensorrt
    except ImportError as exc:
        raise BackendUnavailable(f"TensorRT is not installed ({exc}); {INSTALL_HINT}") from None
    except Exception as exc:  # a wheel whose native libraries are missing raises OSError & co
        raise BackendUnavailable(
            f"TensorRT is installed but does not load ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from None
    if getattr(tensorrt, "__file__", None) is None or not hasattr(tensorrt, "__version__"):
        # A directory named tensorrt on sys.path imports as an empty namespace package.
        where = [str(p) for p in getattr(tensorrt, "__path__", [])]
        raise BackendUnavailable(
            f"TensorRT is not installed ('import tensorrt' found only the directory {where}); "
            f"{INSTALL_HINT}"
        )
    return tensorrt


def device_index(device: str) -> int:
    """``cuda`` -> 0, ``cuda:1`` -> 1."""
    return int(device.partition(":")[2] or 0)


def gpu(index: int) -> tuple[str, str]:
    """(name, compute capability) of CUDA device ``index``."""
    d = cuda.driver()
    return d.name(index), d.compute_capability(index)


def make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` routing TensorRT's log to ``logging``; ``last_errors()`` recalls its
    latest errors for exception messages."""

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: collections.deque[str] = collections.deque(maxlen=10)
            sev = trt.ILogger.Severity
            self.levels = {
                sev.INTERNAL_ERROR: logging.ERROR,
                sev.ERROR: logging.ERROR,
                sev.WARNING: logging.WARNING,
                sev.INFO: logging.DEBUG,
                sev.VERBOSE: logging.DEBUG,
            }

        def log(self, severity: Any, msg: str) -> None:
            level = self.levels.get(severity, logging.DEBUG)
            if level >= logging.ERROR:
                self.errors.append(msg)
            log.log(level, "TensorRT: %s", msg)

        def last_errors(self) -> str:
            return "; ".join(self.errors) or "no details logged"

    return Logger()


# -- build ---------------------------------------------------------------------------------------


def polygraphy_profiles(profiles: Sequence[Mapping[str, ShapeProfile]]) -> list[Any]:
    """Polygraphy ``Profile`` objects for complete profiles (pure Python, no TensorRT)."""
    from polygraphy.backend.trt import Profile

    out = []
    for p in profiles:
        prof = Profile()
        for name, shapes in p.items():
            prof.add(name, min=list(shapes.min), opt=list(shapes.opt), max=list(shapes.max))
        out.append(prof)
    return out


def config_kwargs(plan: BuildPlan) -> dict[str, Any]:
    """Keyword arguments of Polygraphy's ``CreateConfig`` for a plan, TensorRT enums by name
    (``"memory_pool_limits": {"WORKSPACE": n}``, ``"hardware_compatibility_level":
    "AMPERE_PLUS"``): :func:`_with_enums` swaps the names for TensorRT's members.
    """
    flags = plan.precision.builder_flags
    kwargs: dict[str, Any] = {
        "tf32": "TF32" not in plan.precision.cleared_flags,
        "fp16": "FP16" in flags,
        "bf16": "BF16" in flags,
        "int8": "INT8" in flags,
        "profiles": polygraphy_profiles(plan.profiles) or None,
        "memory_pool_limits": dict(plan.memory_pools) or None,
        "builder_optimization_level": plan.builder_optimization_level,
        "hardware_compatibility_level": None
        if plan.hardware_compatibility == "none"
        else plan.hardware_compatibility.upper(),
        "version_compatible": plan.version_compatible or None,
    }
    return kwargs


def _with_enums(trt: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    if out["memory_pool_limits"]:
        out["memory_pool_limits"] = {
            getattr(trt.MemoryPoolType, k): v for k, v in out["memory_pool_limits"].items()
        }
    level = out["hardware_compatibility_level"]
    if level is not None:
        try:
            out["hardware_compatibility_level"] = getattr(trt.HardwareCompatibilityLevel, level)
        except AttributeError:
            raise BuildError(
                f"hardware_compatibility {level.lower()!r} is not available in TensorRT "
                f"{trt.__version__}"
            ) from None
    # TensorRT 11 dropped the precision flags; Polygraphy would fail looking them up.
    for flag in ("fp16", "bf16", "int8"):
        if out[flag] and not hasattr(trt.BuilderFlag, flag.upper()):
            raise BuildError(
                f"TensorRT {trt.__version__} has no {flag.upper()} builder flag (strongly typed "
                "only); this plan was made for TensorRT 10"
            )
    return out


def build_engine(onnx_path: Path, plan: BuildPlan, index: int, workdir: Path) -> dict[str, Any]:
    """Parse ``onnx_path``, build the plan into ``workdir/model.plan`` and the timing cache into
    ``workdir/timing.cache``; load the user's timing cache before and merge it back after.

    Returns:
        facts for the manifest: GPU, timing cache paths and whether one was loaded, seconds.

    Raises:
        BuildError: TensorRT's parser or builder failed (its messages included).
    """
    trt = import_tensorrt()
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    cuda.driver().activate(index)
    name, cc = gpu(index)
    user_cache = (
        timing_cache_path(plan.timing_cache, trt.__version__, name, cc)
        if plan.timing_cache
        else None
    )
    if user_cache is not None:
        user_cache.parent.mkdir(parents=True, exist_ok=True)
    loaded = user_cache is not None and user_cache.is_file()
    cache_out = user_cache or workdir / "timing.cache"
    network = NetworkFromOnnxPath(
        str(onnx_path), strongly_typed="STRONGLY_TYPED" in plan.precision.network_flags
    )
    config = CreateConfig(
        load_timing_cache=str(user_cache) if loaded else None,
        **_with_enums(trt, config_kwargs(plan)),
    )
    start = time.perf_counter()
    severity = G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.ERROR
    try:
        with G_LOGGER.verbosity(severity):
            engine_bytes = EngineBytesFromNetwork(
                network, config, save_timing_cache=str(cache_out)
            )()
    except PolygraphyException as exc:
        raise BuildError(f"TensorRT {trt.__version__} could not build the engine: {exc}") from None
    seconds = time.perf_counter() - start
    (workdir / "model.plan").write_bytes(bytes(engine_bytes))
    if user_cache is not None and user_cache.is_file():
        (workdir / "timing.cache").write_bytes(user_cache.read_bytes())
    return {
        "gpu": name,
        "compute_capability": cc,
        "tensorrt": trt.__version__,
        "engine_build_s": round(seconds, 3),
        "timing_cache": {
            "path": None if user_cache is None else str(user_cache),
            "loaded": loaded,
            "payload": "timing.cache" if (workdir / "timing.cache").is_file() else None,
        },
    }


# -- run -----------------------------------------------------------------------------------------


class _Buffers:
    """Device buffers and pinned host staging for one shape signature of one context."""

    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, np.dtype]
    ) -> None:
        self.shapes = dict(shapes)
        self.device: dict[str, cuda.DeviceBuffer] = {}
        self.host: dict[str, np.ndarray] = {}
        self._pinned: list[cuda.PinnedBuffer] = []
        for name, shape in shapes.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtypes[name].itemsize
            self.device[name] = cuda.DeviceBuffer(nbytes)
            pinned = cuda.PinnedBuffer(nbytes)
            self._pinned.append(pinned)
            self.host[name] = pinned.array(shape, dtypes[name])

    def free(self) -> None:
        for b in self.device.values():
            b.free()
        for p in self._pinned:
            p.free()


class _Slot:
    """One execution context bound to one optimization profile, its stream and buffers."""

    def __init__(self, owner: TrtEngine, index: int) -> None:
        trt = owner.trt
        d = cuda.driver()
        self.owner = owner
        self.stream = d.stream()
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        if strategy is not None and owner.num_profiles > 1:
            # Device memory for the selected profile only, not the largest of all profiles.
            context = owner.engine.create_execution_context(strategy.ON_PROFILE_CHANGE)
        else:
            context = owner.engine.create_execution_context()
        if context is None:
            raise EnginekitError(
                f"TensorRT could not create an execution context for profile {index} (out of "
                f"GPU memory?): {owner.logger.last_errors()}"
            )
        if owner.num_profiles > 1:
            if not context.set_optimization_profile_async(index, self.stream):
                raise EnginekitError(f"TensorRT refused optimization profile {index}")
            d.sync(self.stream)
        self.context = context
        self.lock = threading.Lock()
        self.buffers: collections.OrderedDict[tuple[Any, ...], _Buffers] = collections.OrderedDict()
        self.bound: tuple[Any, ...] | None = None

    def _shape(self, feeds_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Set input shapes on the context; return every tensor's shape (inputs and outputs)."""
        ctx = self.context
        for name, shape in feeds_shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise EngineInputError(
                    f"TensorRT refused input {name!r} shape {shape}: "
                    f"{self.owner.logger.last_errors()}"
                )
        shapes = dict(feeds_shapes)
        for spec in self.owner.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise EnginekitError(
                    f"output {spec.name!r} has a data-dependent shape {shape} (NonZero-like ops); "
                    "enginekit's TensorRT runner needs output shapes known from input shapes"
                )
            shapes[spec.name] = shape
        return shapes

    def run_host(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        d = cuda.driver()
        key = tuple(a.shape for a in feeds.values())
        with self.lock:
            d.activate(self.owner.index)
            bufs = self.buffers.get(key)
            if bufs is None:
                bufs = _Buffers(
                    self._shape({n: a.shape for n, a in feeds.items()}), self.owner.dtypes
                )
                self.buffers[key] = bufs
                if len(self.buffers) > MAX_CACHED_SHAPES:
                    old_key, old = self.buffers.popitem(last=False)
                    old.free()
                    if self.bound == old_key:
                        self.bound = None
                self.bound = None
            else:
                self.buffers.move_to_end(key)
            if self.bound != key:
                self._shape({n: a.shape for n, a in feeds.items()})
                for name, buf in bufs.device.items():
                    self.context.set_tensor_address(name, buf.ptr)
                self.bound = key
            for name, array in feeds.items():
                host = bufs.host[name]
                np.copyto(host, array, casting="no")
                d.to_device(bufs.device[name].ptr, host.ctypes.data, host.nbytes, self.stream)
            self._execute()
            outs = [o.name for o in self.owner.outputs]
            for name in outs:
                host = bufs.host[name]
                d.to_host(host.ctypes.data, bufs.device[name].ptr, host.nbytes, self.stream)
            d.sync(self.stream)
            return {name: bufs.host[name].copy() for name in outs}

    def run_device(
        self, views: Mapping[str, cuda.CudaView], out: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        d = cuda.driver()
        owner = self.owner
        with self.lock:
            d.activate(owner.index)
            for name, v in views.items():
                where = d.pointer_device(v.ptr)
                if where != owner.index:
                    raise EngineInputError(
                        f"input {name!r} is {'host memory' if where is None else f'on cuda:{where}'}; "
                        f"this engine runs on cuda:{owner.index}"
                    )
                if v.stream is not None:
                    d.sync(v.stream)  # the producer's pending writes must land first
            shapes = self._shape({n: v.shape for n, v in views.items()})
            self.bound = None  # addresses below are the caller's; host runs must rebind
            result: dict[str, Any] = {}
            for spec in owner.outputs:
                shape, dtype = shapes[spec.name], owner.dtypes[spec.name]
                if out is not None and spec.name in out:
                    view = cuda.parse_cuda_array(out[spec.name], f"out[{spec.name!r}]")
                    if view.shape != shape or view.dtype != dtype:
                        raise EngineInputError(
                            f"out[{spec.name!r}]: expected {dtype}{list(shape)}, got "
                            f"{view.dtype}{list(view.shape)}"
                        )
                    ptr, result[spec.name] = view.ptr, out[spec.name]
                else:
                    array = cuda.DeviceArray(shape, dtype, owner.index)
                    ptr, result[spec.name] = array.ptr, array
                self.context.set_tensor_address(spec.name, ptr)
            for name, v in views.items():
                self.context.set_tensor_address(name, v.ptr)
            self._execute()
            d.sync(self.stream)
            return result

    def _execute(self) -> None:
        if not self.context.execute_async_v3(self.stream):
            raise EnginekitError(
                f"TensorRT execute_async_v3 failed: {self.owner.logger.last_errors()}"
            )

    def close(self) -> None:
        for bufs in self.buffers.values():
            bufs.free()
        self.buffers.clear()
        self.context = None
        cuda.driver().destroy_stream(self.stream)


class TrtEngine(Engine):
    """An Engine over a deserialized TensorRT plan.

    One execution context per optimization profile, created on first use; each call picks the
    profile whose ranges hold the inputs' shapes (the nearest opt point if several do). Host
    arrays go through pinned staging buffers allocated once per shape signature; CUDA arrays
    (torch, cupy: ``__cuda_array_interface__``) are bound directly, see :meth:`infer_cuda`.

    Attributes:
        engine: the ``tensorrt.ICudaEngine``.
        index: the CUDA device ordinal.
    """

    def __init__(
        self, plan: bytes, manifest: dict[str, Any], index: int, allow_host_code: bool = False
    ) -> None:
        trt = import_tensorrt()
        config = BuildConfig.from_json(manifest["config"])
        inputs = [TensorSpec.from_json(s) for s in manifest["inputs"]]
        outputs = [TensorSpec.from_json(s) for s in manifest["outputs"]]
        super().__init__(inputs, outputs, config.profiles, manifest)
        self.trt = trt
        self.index = index
        cuda.driver().activate(index)
        self.logger = make_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        if allow_host_code:
            # Version-compatible plans carry their own lean runtime, run from the plan itself;
            # the artifact's checksums were verified before these bytes got here.
            self.runtime.engine_host_code_allowed = True
        engine = self.runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise ArtifactError(
                f"TensorRT {trt.__version__} could not deserialize the plan: "
                f"{self.logger.last_errors()}"
            )
        self.engine = engine
        self.trt_profiles = plan_profiles(self.inputs, config.profiles)
        self.num_profiles = max(1, len(self.trt_profiles))
        if engine.num_optimization_profiles != self.num_profiles:
            raise ArtifactError(
                f"the plan has {engine.num_optimization_profiles} optimization profiles, the "
                f"manifest lists {self.num_profiles}; the artifact is inconsistent, rebuild it"
            )
        self.dtypes = self._check_io()
        self._slots: list[_Slot | None] = [None] * self.num_profiles
        self._slots_lock = threading.Lock()

    def _check_io(self) -> dict[str, np.dtype]:
        trt, engine = self.trt, self.engine
        dtypes = {}
        for spec, mode in [(s, trt.TensorIOMode.INPUT) for s in self.inputs] + [
            (s, trt.TensorIOMode.OUTPUT) for s in self.outputs
        ]:
            if engine.get_tensor_mode(spec.name) != mode:
                raise ArtifactError(f"the plan has no {mode.name.lower()} tensor {spec.name!r}")
            kind = engine.get_tensor_dtype(spec.name).name
            got = _NUMPY.get(kind, kind.lower())
            if got != spec.dtype:
                raise ArtifactError(
                    f"tensor {spec.name!r} is {got} in the plan but {spec.dtype} in the manifest"
                )
            dtypes[spec.name] = _numpy_dtype(got)
        return dtypes

    def _slot(self, index: int) -> _Slot:
        slot = self._slots[index]
        if slot is None:
            with self._slots_lock:
                slot = self._slots[index]
                if slot is None:
                    cuda.driver().activate(self.index)
                    slot = self._slots[index] = _Slot(self, index)
        return slot

    def _profile(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        index = select_profile(self.trt_profiles, shapes)
        if index is None:
            raise EngineInputError(
                f"input shapes {dict(shapes)} fit no optimization profile of this engine"
            )
        return index

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        index = self._profile({n: a.shape for n, a in feeds.items()})
        return self._slot(index).run_host(feeds)

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        """Like :meth:`Engine.infer`; CUDA arrays are accepted too (results copied to host)."""
        if _holds_cuda(batch):
            return {k: v.numpy() for k, v in self.infer_cuda(batch).items()}
        return super().infer(batch)

    def infer_cuda(self, batch: Batch, out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run on CUDA arrays and return CUDA arrays: no host round trip.

        Args:
            batch: torch CUDA tensors, cupy arrays or anything with ``__cuda_array_interface__``
                (C-contiguous, on this engine's device), as a mapping, sequence or single array.
            out: optional preallocated CUDA arrays to write outputs into, by output name.

        Returns:
            output name -> the ``out`` array given for it, or a new :class:`cuda.DeviceArray`
            (``torch.as_tensor(a, device="cuda")`` / ``cupy.asarray(a)`` take it without a copy).

        Raises:
            EngineInputError: bad names, dtypes or shapes; a batch that needs splitting (split it
                on the device yourself); an array on another device.
        """
        if self._closed:
            raise EnginekitError("infer_cuda() on a closed engine; load it again")
        names = [s.name for s in self.inputs]
        if isinstance(batch, Mapping):
            items = dict(batch)
        elif isinstance(batch, (list, tuple)):
            items = dict(zip(names, batch))
        else:
            items = {names[0]: batch} if len(names) == 1 else {}
        if sorted(items) != sorted(names):
            raise EngineInputError(f"infer_cuda needs inputs {names}, got {sorted(items)}")
        views = {n: cuda.parse_cuda_array(items[n], f"input {n!r}") for n in names}
        rows = self._check(cast(Any, views))
        if rows is not None:
            raise EngineInputError(
                f"on-device batch of {rows} rows: it is empty or larger than the largest profile; "
                "split it on the device (or pass host arrays, which enginekit splits)"
            )
        index = self._profile({n: v.shape for n, v in views.items()})
        return self._slot(index).run_device(views, out)

    def _close(self) -> None:
        cuda.driver().activate(self.index)
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._slots = []
        self.engine = None
        self.runtime = None


def _holds_cuda(batch: Batch) -> bool:
    values = (
        batch.values()
        if isinstance(batch, Mapping)
        else (batch if isinstance(batch, (list, tuple)) else [batch])
    )
    flags = [cuda.is_cuda_array(v) for v in values]
    if any(flags) and not all(flags):
        raise EngineInputError(
            "some inputs are CUDA arrays and some are host arrays; pass all on the GPU or all on "
            "the host"
        )
    return bool(flags) and all(flags)


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
