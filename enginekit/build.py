"""``build`` and ``load``: model + BuildConfig -> verified artifact -> Engine."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginekit import __version__, backends, target
from enginekit.artifact import FORMAT_VERSION, Artifact, open_artifact, write_artifact
from enginekit.calibration import plan
from enginekit.calibration.accuracy import Gates
from enginekit.config import BuildConfig, Precision, ShapeProfile, ShapesArg, normalize_shapes
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import (
    ArtifactError,
    BackendUnavailable,
    BuildError,
    EnginekitError,
    VerificationError,
)
from enginekit.model import Model, ModelSource, load_model
from enginekit.passes import PassRecord, count_nodes, prepare
from enginekit.progress import step
from enginekit.verify import summarize, verify_engine

log = logging.getLogger(__name__)


def check_profiles(model: Model, profiles: tuple[dict[str, ShapeProfile], ...]) -> None:
    """Every profile names real inputs, with their rank and fixed dims, and all profiles cover
    the same inputs.

    Raises:
        BuildError: naming the input and dim at fault.
    """
    specs = {s.name: s for s in model.inputs}
    covered = None
    for i, p in enumerate(profiles):
        for name, prof in p.items():
            if name not in specs:
                raise BuildError(
                    f"shapes name input {name!r}, which the model does not have (inputs: "
                    f"{', '.join(specs)})"
                )
            spec = specs[name]
            if len(prof.min) != len(spec.shape):
                raise BuildError(
                    f"shapes for {name!r} have rank {len(prof.min)}; the model's input is "
                    f"rank {len(spec.shape)} {spec.shape}"
                )
            for axis, d in enumerate(spec.shape):
                if isinstance(d, int) and not prof.min[axis] == prof.max[axis] == d:
                    raise BuildError(
                        f"shapes for {name!r} dim {axis}: the model fixes it to {d}, the "
                        f"profile gives {prof.min[axis]}..{prof.max[axis]}"
                    )
        if covered is not None and set(p) != covered:
            raise BuildError(
                f"profile {i} covers inputs {sorted(p)}, profile 0 covers {sorted(covered)}; "
                "every profile must cover the same inputs"
            )
        covered = set(p)


def build_key(
    model: Model, config: BuildConfig, backend_version: str | None, calibration: str | None = None
) -> str:
    """SHA-256 of everything that decides the build's output: same key, same engine."""
    blob = json.dumps(
        {
            "model": model.sha256,
            "config": config.to_json(),
            "backend_version": backend_version,
            "calibration": calibration,
            "enginekit": __version__,
            "host": {"machine": target.host()["machine"], "isa": target.host()["isa"]},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build(
    model: ModelSource,
    backend: str = "onnxruntime",
    shapes: ShapesArg = None,
    precision: str = "fp32",
    output: str | os.PathLike | None = None,
    device: str = "cpu",
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    config: BuildConfig | None = None,
    simplify: bool = True,
    outputs: Sequence[str] = (),
    *,
    calibration: Any = None,
    calib_data: Any = None,
    calib_method: str = "entropy",
    verify_data: Any = None,
    min_top1_agreement: float | None = None,
    max_abs_error: float | None = None,
    allow_table_mismatch: bool = False,
    **options: Any,
) -> Engine:
    """Build an engine from an ONNX model, verify it, optionally write the artifact, return it.

    Args:
        model: path to an ONNX file, a ModelProto or a Model.
        backend: registered backend name.
        shapes: per-input shapes: ``{"x": [(1, 16), (8, 16), (64, 16)]}`` (min, opt, max),
            ``{"x": (8, 16)}`` (fixed) or trtexec text; a list of dicts for several profiles.
        precision: fp32, fp16, bf16 or int8.
        output: where to write the artifact (``.ekit`` file, or a directory path ending in ``/``).
        device: ``cpu`` or ``cuda[:N]``.
        verify: compare with ONNX Runtime CPU at build time; a mismatch raises VerificationError.
        atol, rtol: verification tolerance (default: the precision's).
        config: a complete BuildConfig instead of the arguments above.
        simplify: fold constants and simplify the graph first (recorded in manifest["passes"]);
            verification still compares with the model as given.
        outputs: build only the subgraph computing these tensors, for debugging a mismatch.
        calibration: int8: a CalibrationTable or the path of its JSON (``enginekit calibrate``).
        calib_data: int8: calibration data to calibrate on the fly (any source
            ``enginekit.calibrate`` takes); every 10th sample is held out for verification.
        calib_method: int8 with calib_data: entropy (default), percentile or minmax.
        verify_data: int8: data to verify the engine on against the float32 model.
        min_top1_agreement, max_abs_error: accuracy gates on the verification data (int8); a
            miss raises VerificationError.
        allow_table_mismatch: accept a calibration table made for another model hash.
        **options: backend options (``enginekit backends --json`` lists each backend's).
            With ``backend="auto"`` also ``candidates``, ``precisions``, ``objective``,
            ``bench_duration``: see :func:`enginekit.choose.build_auto`.

    Raises:
        BuildError, VerificationError, BackendUnavailable, ModelError.
    """
    quant = plan.Quantization(
        calibration, calib_data, calib_method, verify_data,
        Gates(min_top1_agreement, max_abs_error), allow_table_mismatch,
    )  # fmt: skip
    if (config.backend if config is not None else backend) == "auto":
        from enginekit.choose import build_auto

        if quant != plan.Quantization():
            raise BuildError(
                "calibration, calib_data, verify_data and the accuracy gates apply to one "
                "backend's int8 build; name the backend instead of 'auto'"
            )
        if (
            outputs
            or not simplify
            or (config is not None and (config.outputs or not config.simplify))
        ):
            raise BuildError(
                "simplify=False and outputs= apply to one backend's build; name the backend "
                "instead of 'auto'"
            )

        return build_auto(
            model, shapes, precision, output, device, verify, atol, rtol, config, **options
        )
    if config is None:
        config = BuildConfig(
            backend=backend,
            profiles=normalize_shapes(shapes),
            precision=precision,  # type: ignore[arg-type]
            device=device,
            verify=verify,
            atol=atol,
            rtol=rtol,
            options=options,
            simplify=simplify,
            outputs=tuple(outputs),
        )
    with step("loading model"):
        model = load_model(model)
    be = backends.require(config.backend, config.device)
    backends.check_options(be, config.options)
    plan.check_precision(be, config)
    if not config.outputs:
        check_profiles(model, config.profiles)  # fail fast, before any graph pass
    if config.outputs and config.precision == Precision.INT8:
        raise BuildError("outputs= (subgraph builds) works at fp32/fp16/bf16, not int8")
    # int8: the Q/DQ model (written from the table) or the model's own Q/DQ nodes.
    quantized = plan.prepare(model, config, be, quant)
    # Simplification could fold Q/DQ pairs into float weights: never on a quantized model.
    keep_qdq = plan.has_qdq(quantized.model.proto)
    with step("preparing the graph"):
        # The backend builds the prepared graph; the manifest's source hash stays the user's.
        prepared = prepare(
            quantized.model,
            simplify=config.simplify and not keep_qdq,
            outputs=config.outputs,
            opsets=getattr(be, "OPSETS", None),
        )
    if keep_qdq and config.simplify:
        n = count_nodes(quantized.model.proto)
        skipped = PassRecord("simplify", n, n, 0.0, {"skipped": "Q/DQ model"})
        prepared = dataclasses.replace(prepared, passes=(skipped, *prepared.passes))
    reference = model if keep_qdq else prepared.reference
    check_profiles(reference, config.profiles)
    version = be.available().version
    workdir = Path(tempfile.mkdtemp(prefix="enginekit-build-"))
    try:
        start = time.perf_counter()
        with step(f"building {config.backend} engine"):
            result = be.build(prepared.model, config, workdir)
        build_s = time.perf_counter() - start
        manifest = {
            "format_version": FORMAT_VERSION,
            "enginekit_version": __version__,
            "backend": {
                "name": config.backend,
                "version": version,
                "metadata": dict(result.metadata),
            },
            "target": {**target.host(), **dict(result.target)},
            "source": {
                "sha256": model.sha256,
                "path": str(model.path) if model.path else None,
                "opset": model.opset,
            },
            "config": config.to_json(),
            "inputs": [s.to_json() for s in reference.inputs],
            "outputs": [s.to_json() for s in reference.outputs],
            "passes": [p.to_json() for p in prepared.passes],
            "profiles": config.to_json()["profiles"],
            "precision": config.precision.value,
            "calibration": quantized.entry,
            "build_key": build_key(model, config, version, quantized.table_hash),
            "build": {
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
                "build_s": round(build_s, 3),
                "host": target.host(),
                "versions": _toolchain(),
            },
            "verify": None,
            "bench": None,
        }
        staged = Artifact(
            workdir, {**manifest, "payload": {n: _entry(workdir / n) for n in result.files}}
        )
        _stage_layout(workdir, result.files)
        cross = result.metadata.get("cross_compiled")
        if cross:  # code for another host: write it, but neither load nor verify it here
            return _unloaded(manifest, workdir, result.files, output, str(cross))
        engine = be.load(staged, config.device)
        if config.verify and config.precision == Precision.INT8:
            report = plan.verify(engine, model, config, quantized, quant)
            manifest["verify"] = report
            if not report["passed"]:
                engine.close()
                raise VerificationError(
                    f"the int8 {config.backend} engine fails its accuracy gates on "
                    f"{report['data']}: {'; '.join(report['failures'])}",
                    report,
                )
        elif config.verify:
            with step("verifying against ONNX Runtime CPU"):
                report = verify_engine(engine, reference, config)
            manifest["verify"] = report
            if not report["passed"]:
                engine.close()
                raise VerificationError(
                    f"the {config.backend} engine disagrees with the reference past atol="
                    f"{report['atol']}, rtol={report['rtol']}: {summarize(report)}",
                    report,
                )
        if output is not None:
            with step(f"writing {output}"):
                written = write_artifact(output, manifest, workdir / "payload", result.files)
            engine.manifest = open_artifact(written).manifest
        else:
            engine.manifest = staged.manifest | manifest
        # The engine may map payload files (native libraries): keep them until it is gone.
        weakref.finalize(engine, shutil.rmtree, workdir, True)
        return engine
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


class _CrossCompiled(Engine):
    """The engine of a cross-compiled build: it describes the artifact but cannot run here."""

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        raise EnginekitError(
            f"this engine was cross-compiled ({self.manifest['backend']['metadata']['cross_compiled']}); "
            "copy its artifact to a host of its target and enginekit.load it there"
        )


def _unloaded(
    manifest: dict[str, Any], workdir: Path, files: tuple[str, ...], output: Any, why: str
) -> Engine:
    if output is None:
        raise BuildError(
            f"the build targets another host ({why}) and cannot run here: pass output= to "
            "write the artifact"
        )
    log.warning("cross-compiled build (%s): written without loading or verifying it", why)
    with step(f"writing {output}"):
        written = write_artifact(output, manifest, workdir / "payload", files)
    shutil.rmtree(workdir, ignore_errors=True)
    spec = open_artifact(written).manifest
    return _CrossCompiled(
        [TensorSpec.from_json(s) for s in spec["inputs"]],
        [TensorSpec.from_json(s) for s in spec["outputs"]],
        BuildConfig.from_json(spec["config"]).profiles,
        spec,
    )


def _toolchain() -> dict[str, str]:
    """Versions besides enginekit's and the backend's that shape an artifact (for rebuilds)."""
    import numpy
    import onnx

    return {"onnx": onnx.__version__, "numpy": numpy.__version__}


def _entry(path: Path) -> dict[str, Any]:
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"sha256": h, "size": path.stat().st_size}


def _stage_layout(workdir: Path, files: tuple[str, ...]) -> None:
    """Move payload files under workdir/payload/ so the workdir reads as a directory artifact."""
    for name in files:
        dest = workdir / "payload" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(workdir / name, dest)


def load(path: str | os.PathLike, device: str | None = None) -> Engine:
    """Load an engine artifact (``.ekit`` file or directory) and return its Engine.

    Checks the format version, every payload checksum, that the backend is installed, and that
    this host can run the artifact's target; no compilation happens here.

    Raises:
        ArtifactError: what is wrong, and what to do (usually: rebuild from the source model).
    """
    artifact = open_artifact(path)
    manifest = artifact.manifest
    name = manifest.get("backend", {}).get("name")
    device = device or manifest.get("config", {}).get("device", "cpu")
    try:
        be = backends.require(str(name), str(device))
    except BackendUnavailable as exc:
        raise ArtifactError(f"{path}: cannot load a {name} engine here: {exc}") from None
    problems = target.missing_features(manifest.get("target", {}))
    if problems:
        raise ArtifactError(
            f"{path}: built for a host with {'; '.join(problems)}. Rebuild it on this host: "
            f"enginekit build {manifest.get('source', {}).get('path') or '<model.onnx>'} "
            f"--backend {name}"
        )
    engine = be.load(artifact, str(device))
    engine.manifest = manifest
    return engine
