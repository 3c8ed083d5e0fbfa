"""TensorRT backend: serialized plans with min/opt/max optimization profiles, explicit precision
(fp16/bf16 tensors or Q/DQ in the ONNX model on TensorRT 11; builder flags or the same on 10),
a timing cache kept per GPU and TensorRT version, and a manifest that refuses to load a plan on
the wrong TensorRT or GPU with a rebuild command instead of an opaque error.

Modules: ``plan`` (pure planning), ``precision`` (ONNX rewrites), ``ops`` (the parser's operator
table), ``compat`` (load-time checks), ``ortep`` (ONNX Runtime's TensorRT EP options),
``device`` and ``cuda`` (TensorRT and the GPU; imported only when building or loading).
TensorRT itself is not on PyPI: docs/backends/tensorrt.md says how to install it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from enginekit.backends import Availability, BuildResult
from enginekit.backends.tensorrt import compat, ops, plan, precision
from enginekit.errors import ArtifactError, BackendUnavailable, BuildError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.config import BuildConfig
    from enginekit.engine import Engine
    from enginekit.model import Model

NAME = "tensorrt"
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
PLAN = "model.plan"
TIMING_CACHE = "timing.cache"

OPTIONS = {
    "timing_cache": "timing cache file or directory (CLI --timing-cache): loaded before the "
    "build and merged back after, one file per GPU and TensorRT version",
    "workspace": "builder workspace pool limit, bytes or text such as '4GiB' (CLI --workspace; "
    "default TensorRT's: the GPU's memory)",
    "memory_pools": "other memory pool limits: {pool: size}, pools workspace, tactic_dram, "
    "tactic_shared_memory, dla_managed_sram, dla_local_dram, dla_global_dram",
    "builder_optimization_level": "0-5 (TensorRT's default 3): higher searches longer for "
    "faster kernels",
    "hardware_compatibility": "none (default), ampere_plus (plan loads on any Ampere or newer "
    "GPU) or same_compute_capability",
    "version_compatible": "true: later TensorRT runtimes of the same major version can load "
    "the plan (it embeds a lean runtime; slower to build, bigger)",
    "strongly_typed": "TensorRT 10 only: take precision from the ONNX types (fp16/bf16 "
    "rewrite) instead of builder flags; always the case on TensorRT 11",
    "tf32": "allow TF32 math in fp32 layers (default false, so fp32 engines meet fp32 tolerances)",
    "fp32_ops": "op types the fp16/bf16 rewrite keeps in fp32 (default: Pow and the square/"
    "log-sum reductions)",
    "qdq_model": "int8: path of the Q/DQ ONNX model calibration made from this model",
    "check_ops": "check every op against TensorRT's ONNX operator table before building "
    "(default true; false for models relying on plugins)",
}


def available() -> Availability:
    """TensorRT's version and CUDA devices; the reason (and how to install) when unavailable."""
    from enginekit.backends.tensorrt import cuda, device

    try:
        trt = device.import_tensorrt()
    except BackendUnavailable as exc:
        return Availability(NAME, False, reason=str(exc))
    version = str(trt.__version__)
    try:
        plan.generation(version)
    except BuildError as exc:
        return Availability(NAME, False, version, reason=str(exc))
    try:
        import polygraphy  # noqa: F401  (builds go through its loaders)
    except ImportError:
        return Availability(
            NAME, False, version, reason="Polygraphy is not installed: pip install polygraphy"
        )
    count = cuda.device_count()
    if count == 0:
        return Availability(
            NAME,
            False,
            version,
            reason=f"TensorRT {version} is installed but there is no CUDA device here (no "
            "NVIDIA driver, or no GPU visible: check nvidia-smi and CUDA_VISIBLE_DEVICES)",
        )
    return Availability(NAME, True, version, tuple(f"cuda:{i}" for i in range(count)))


def supported_ops() -> list[str]:
    """The ai.onnx ops TensorRT's ONNX parser supports (from its documented operator table)."""
    return ops.supported_ops()


def network_model(
    model: Model, build_plan: plan.BuildPlan, quantizer: precision.Quantizer | None = None
) -> tuple[onnx.ModelProto, str | None]:
    """The ONNX model TensorRT will parse, after the plan's rewrite, and its calibration hash.

    Checks the ops first (unless ``check_ops`` is off). Pure Python: runs without TensorRT.

    Args:
        model: the source model.
        build_plan: from :func:`plan.plan_build`.
        quantizer: for int8, a callable source ModelProto -> Q/DQ ModelProto (takes precedence
            over the ``qdq_model`` option). This is where calibration plugs in.

    Returns:
        (model to parse, SHA-256 of the Q/DQ model when one replaced the source, else None).
    """
    if build_plan.check_ops:
        ops.check_ops(model.proto)
    rewrite = build_plan.precision.rewrite
    if rewrite in ("fp16", "bf16"):
        return precision.to_low_precision(model.proto, rewrite, build_plan.precision.fp32_ops), None
    if rewrite == "qdq":
        qdq = precision.quantized_model(model.proto, quantizer or build_plan.qdq_model)
        if build_plan.check_ops:
            ops.check_ops(qdq)
        return qdq, precision.model_sha256(qdq)
    if build_plan.precision.precision == "int8":
        precision.check_qdq(model.proto, model.proto)
    return model.proto, None


def build(
    model: Model,
    config: BuildConfig,
    workdir: Path,
    quantizer: precision.Quantizer | None = None,
) -> BuildResult:
    """Plan, rewrite and build the TensorRT plan into ``workdir`` (needs TensorRT and a GPU).

    Args:
        quantizer: int8 only — a callable returning the Q/DQ model of ``model.proto``.
    """
    from enginekit.backends.tensorrt import device

    if not config.device.startswith("cuda"):
        raise BuildError(
            f"TensorRT builds for a GPU; got device {config.device!r}: pass device='cuda' "
            "(CLI --device cuda)"
        )
    trt = device.import_tensorrt()
    build_plan = plan.plan_build(
        model, config, str(trt.__version__), has_quantizer=quantizer is not None
    )
    proto, calibration = network_model(model, build_plan, quantizer)
    net_dir = workdir / "network"
    net_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = net_dir / "model.onnx"
    onnx.save_model(
        proto,
        str(onnx_path),
        save_as_external_data=proto.ByteSize() > (1 << 30),
        location="model.onnx.data",
    )
    try:
        facts = device.build_engine(
            onnx_path, build_plan, device.device_index(config.device), workdir
        )
    finally:
        shutil.rmtree(net_dir, ignore_errors=True)
    cc = facts["compute_capability"]
    files = (PLAN,) + ((TIMING_CACHE,) if facts["timing_cache"]["payload"] else ())
    return BuildResult(
        files=files,
        metadata={
            "plan": build_plan.to_json(),
            "build_key": plan.build_key(model, config, str(trt.__version__), cc, calibration),
            "calibration_sha256": calibration,
            **facts,
        },
        target={
            "kind": "cuda",
            "compute_capability": cc,
            "gpu": facts["gpu"],
            "tensorrt": str(trt.__version__),
            "hardware_compatibility": build_plan.hardware_compatibility,
            "version_compatible": build_plan.version_compatible,
        },
    )


def load(artifact: Artifact, device_name: str) -> Engine:
    """Deserialize the plan on ``device_name`` after checking TensorRT version and GPU.

    Raises:
        ArtifactError: another TensorRT version or GPU than the plan was built for, with the
            command that rebuilds it here.
    """
    from enginekit.backends.tensorrt import device

    if not device_name.startswith("cuda"):
        raise ArtifactError(
            f"{artifact.path}: TensorRT engines run on a GPU; load with device='cuda', got "
            f"{device_name!r}"
        )
    trt = device.import_tensorrt()
    index = device.device_index(device_name)
    name, cc = device.gpu(index)
    manifest = dict(artifact.manifest)
    compat.check_loadable(manifest, str(trt.__version__), cc, name, str(artifact.path))
    return device.TrtEngine(
        artifact.read(PLAN),
        manifest,
        index,
        allow_host_code=bool(manifest.get("target", {}).get("version_compatible")),
    )


def inspect(artifact: Artifact, ir: bool = False) -> dict[str, Any]:
    """What the manifest says about the plan; with ``ir``, TensorRT's layer listing (GPU only)."""
    manifest = artifact.manifest
    target = manifest.get("target", {})
    meta = manifest.get("backend", {}).get("metadata", {})
    prec = (meta.get("plan") or {}).get("precision") or {}
    info: dict[str, Any] = {
        "tensorrt": target.get("tensorrt"),
        "gpu": f"{target.get('gpu')} (compute capability {target.get('compute_capability')})",
        "precision": f"{prec.get('precision')}: rewrite {prec.get('rewrite')}, strongly typed "
        f"{prec.get('strongly_typed')}, flags {prec.get('builder_flags')}",
        "compat": f"hardware {target.get('hardware_compatibility')}, version-compatible "
        f"{target.get('version_compatible')}",
        "timing": (meta.get("timing_cache") or {}).get("path") or "payload only",
    }
    if ir:
        info["layers"] = _layers(artifact)
    return info


def _layers(artifact: Artifact) -> Any:
    """TensorRT's engine inspector output, or why it is not available here."""
    try:
        engine = load(artifact, str(artifact.manifest.get("config", {}).get("device", "cuda")))
    except (BackendUnavailable, ArtifactError) as exc:
        return f"unavailable here: {exc}"
    try:
        trt_engine = engine.engine  # type: ignore[attr-defined]
        inspector = trt_engine.create_engine_inspector()
        return inspector.get_engine_information(engine.trt.LayerInformationFormat.JSON)  # type: ignore[attr-defined]
    finally:
        engine.close()
