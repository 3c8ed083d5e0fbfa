"""``build``: model + BuildConfig -> verified artifact -> Engine, as a chain of named stages.

:func:`build` reads as its stages, each a small function taking and returning frozen
dataclasses::

    Request -> _load_and_check -> _quantize -> _prepare_graph -> _compile -> _manifest
            -> _stage -> _verify -> _write

A new stage (a cache lookup, profiling) goes between two of them and adds its own dataclass.
A name in :data:`STRATEGIES` stands for a backend name and takes over the whole build
(``backend="auto"``). ``enginekit.load`` lives with the backend registry
(:func:`enginekit.backends.load`): loading needs no build machinery.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit import backends, target
from enginekit.artifact import (
    FORMAT_VERSION,
    Artifact,
    build_key,
    open_artifact,
    payload_entries,
    write_artifact,
)
from enginekit.backends import Backend, BuildResult
from enginekit.calibration import plan
from enginekit.calibration.accuracy import Gates
from enginekit.calibration.search import AccuracyTarget
from enginekit.config import BuildConfig, Precision, ShapesArg, normalize_shapes
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import BuildError, EnginekitError, VerificationError
from enginekit.model import Model, ModelSource, check_profiles, load_model
from enginekit.passes import PassRecord, count_nodes, prepare
from enginekit.progress import step
from enginekit.quiet import native_stderr
from enginekit.verify import summarize, verify_engine
from enginekit.version import __version__

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
    """What :func:`build` was asked for.

    Attributes:
        config: the whole build configuration (backend options in ``config.options``).
        quant: the int8 arguments: calibration table or data, verification data, gates.
        output: where to write the artifact; None keeps it in memory only.
    """

    config: BuildConfig
    quant: plan.Quantization
    output: str | os.PathLike | None = None


#: Names that stand for a backend name and take over the whole build, called with the
#: user's model and the :class:`Request`. ``"auto"`` (build every candidate, keep the best) is
#: :func:`enginekit.evaluate.choose.build_auto`, registered by ``enginekit/__init__.py``.
STRATEGIES: dict[str, Callable[[ModelSource, Request], Engine]] = {}


@dataclasses.dataclass(frozen=True)
class Checked:
    """The user's model, loaded, and the backend that builds it, both checked against the
    request before any graph pass runs."""

    model: Model
    backend: Backend
    version: str | None


@dataclasses.dataclass(frozen=True)
class Graph:
    """What the backend builds, and what the engine is verified against.

    Attributes:
        model: the graph the backend builds (after int8 quantization and the graph passes).
        reference: what verification compares with: the user's model (its selected subgraph
            with ``outputs``), untouched by the passes; when the graph carries Q/DQ nodes (int8
            from a table, or a QAT model), the source model as it was loaded.
        passes: every graph pass that ran, for ``manifest["passes"]``.
        quantized: the int8 stage's result (the source model itself at other precisions).
    """

    model: Model
    reference: Model
    passes: tuple[PassRecord, ...]
    quantized: plan.Quantized


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the backend wrote into the build's workdir, and how long it took."""

    workdir: Path
    result: BuildResult
    seconds: float

    @property
    def cross_compiled(self) -> str | None:
        """Why the payload cannot run here (code for another host), or None."""
        why = self.result.metadata.get("cross_compiled")
        return str(why) if why else None


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
    rule: str = "scaled",
    min_cosine: float | None = None,
    min_top1_agreement: float | None = None,
    max_abs_error: float | None = None,
    allow_table_mismatch: bool = False,
    accuracy_target: AccuracyTarget | None = None,
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
        atol, rtol: verification tolerance (default: the precision's for ``rule``).
        config: a complete BuildConfig instead of the arguments above (``**options`` are
            added to its options).
        simplify: fold constants and simplify the graph first (recorded in manifest["passes"]);
            verification still compares with the model as given.
        outputs: build only the subgraph computing these tensors, for debugging a mismatch.
        calibration: int8: a CalibrationTable or the path of its JSON (``enginekit calibrate``).
        calib_data: int8: calibration data to calibrate on the fly (any source
            ``enginekit.calibrate`` takes); every 10th sample is held out for verification.
        calib_method: int8 with calib_data: entropy (default), percentile or minmax.
        verify_data: data to verify the engine on (any precision): arrays, a mapping input
            name -> array, an ``.npz``, a folder of ``.npy``/``.npz``, or an iterable of
            batches. Without it, generated inputs (valid values for integer shape/index
            inputs; int8: the samples held out of ``calib_data``).
        rule: verification rule: ``scaled`` (error relative to each output's scale, plus
            cosine similarity) or ``elementwise`` (``atol + rtol*|ref|`` per element); see
            docs/verification.md.
        min_cosine: cosine-similarity floor of the scaled rule (default: the precision's).
        min_top1_agreement, max_abs_error: accuracy gates on the verification data (int8); a
            miss raises VerificationError.
        allow_table_mismatch: accept a calibration table made for another model hash.
        accuracy_target: int8: an :class:`~enginekit.AccuracyTarget` (e.g.
            ``AccuracyTarget(min_top1_agreement=0.97)``): the fastest plan meeting it, keeping
            the most sensitive layers in float (docs/calibration.md); its limits are also the
            verification gates. Needs calib_data (held-out rows) or verify_data.
        **options: backend options (``enginekit backends --json`` lists each backend's).
            With ``backend="auto"`` also ``candidates``, ``precisions``, ``objective``,
            ``bench_duration``: see :func:`enginekit.evaluate.choose.build_auto`.

    Raises:
        BuildError, VerificationError, BackendUnavailable, ModelError.
    """
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
            rule=rule,
            min_cosine=min_cosine,
        )
    elif options:
        config = dataclasses.replace(config, options={**config.options, **options})
    quant = plan.Quantization(
        calibration, calib_data, calib_method, verify_data,
        Gates(min_top1_agreement, max_abs_error), allow_table_mismatch, accuracy_target,
    )  # fmt: skip
    request = Request(config, quant, output)
    if config.backend in STRATEGIES:
        return STRATEGIES[config.backend](model, request)
    checked = _load_and_check(model, request)
    quantized = _quantize(checked, request)
    if quantized.options:  # the search's choice (the bf16 float part's f32 layers) is built
        config = dataclasses.replace(config, options={**config.options, **quantized.options})
        request = dataclasses.replace(request, config=config)
    graph = _prepare_graph(checked, quantized, config)
    data = _verify_batches(request, graph)
    if data:  # programs specialized to input values: compile the one verification runs
        config = dataclasses.replace(config, verify_example=data[0])
    workdir = Path(tempfile.mkdtemp(prefix="enginekit-build-"))
    try:
        compiled = _compile(checked, graph, config, workdir)
        manifest = _manifest(request, checked, graph, compiled)
        if compiled.cross_compiled:  # code for another host: written, neither loaded nor verified
            return _write_unloaded(manifest, compiled, output)
        staged = _stage(compiled, manifest)
        with native_stderr(_what(checked, config)):
            engine = checked.backend.load(staged, config.device)
            report = _verify(engine, request, checked, graph, data)
        return _write(engine, {**staged.manifest, "verify": report}, compiled, output)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


# -- the stages --------------------------------------------------------------------------------


def _load_and_check(source: ModelSource, request: Request) -> Checked:
    """Load the model and the backend, and refuse what cannot build before any slow work."""
    config = request.config
    with step("loading model"):
        model = load_model(source)
    backend = backends.require(config.backend, config.device)
    backends.check_options(backend, config.options)
    plan.check_precision(backend, config)
    if not config.outputs:
        check_profiles(model, config.profiles)
    if config.outputs and config.precision == Precision.INT8:
        raise BuildError("outputs= (subgraph builds) works at fp32/fp16/bf16, not int8")
    return Checked(model, backend, backend.available().version)


def _quantize(checked: Checked, request: Request) -> plan.Quantized:
    """int8: the Q/DQ model written from the calibration table, or the model's own Q/DQ
    nodes; at other precisions the source model unchanged."""
    return plan.quantize(checked.model, request.config, checked.backend, request.quant)


def _prepare_graph(checked: Checked, quantized: plan.Quantized, config: BuildConfig) -> Graph:
    """The graph passes (subgraph, simplification, opset conversion) the backend's build needs.

    The backend builds the prepared graph; the manifest's source hash stays the user's.
    Simplification could fold Q/DQ pairs into float weights: never on a quantized model.
    """
    keep_qdq = plan.has_qdq(quantized.model.proto)
    with step("preparing the graph"):
        prepared = prepare(
            quantized.model,
            simplify=config.simplify and not keep_qdq,
            outputs=config.outputs,
            opsets=getattr(checked.backend, "OPSETS", None),
        )
    passes = prepared.passes
    if keep_qdq and config.simplify:
        n = count_nodes(quantized.model.proto)
        passes = (PassRecord("simplify", n, n, 0.0, {"skipped": "Q/DQ model"}), *passes)
    reference = checked.model if keep_qdq else prepared.reference
    check_profiles(reference, config.profiles)
    return Graph(prepared.model, reference, passes, quantized)


def _compile(checked: Checked, graph: Graph, config: BuildConfig, workdir: Path) -> Compiled:
    """The backend's build: payload files into ``workdir``; may be slow."""
    start = time.perf_counter()
    with step(f"building {config.backend} engine"), native_stderr(_what(checked, config)):
        result = checked.backend.build(graph.model, config, workdir)
    return Compiled(workdir, result, time.perf_counter() - start)


def _manifest(
    request: Request, checked: Checked, graph: Graph, compiled: Compiled
) -> dict[str, Any]:
    """Everything the build did and needs, as the artifact's manifest.json records it (less
    the payload checksums, added when it is staged or written)."""
    config, model, result = request.config, checked.model, compiled.result
    return {
        "format_version": FORMAT_VERSION,
        "enginekit_version": __version__,
        "backend": {
            "name": config.backend,
            "version": checked.version,
            "metadata": dict(result.metadata),
        },
        "target": {**target.host(), **dict(result.target)},
        "source": {
            "sha256": model.sha256,
            "path": str(model.path) if model.path else None,
            "opset": model.opset,
        },
        "config": config.to_json(),
        "inputs": [s.to_json() for s in graph.reference.inputs],
        "outputs": [s.to_json() for s in graph.reference.outputs],
        # Graph passes, then those the backend ran itself (e.g. ONNX Runtime's fusions).
        "passes": [p.to_json() for p in graph.passes] + list(result.metadata.get("passes", [])),
        "profiles": config.to_json()["profiles"],
        "precision": config.precision.value,
        "calibration": graph.quantized.entry,
        "build_key": build_key(model, config, checked.version, graph.quantized.table_hash),
        "build": {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "build_s": round(compiled.seconds, 3),
            "host": target.host(),
            "versions": _toolchain(),
        },
        "verify": None,
        "bench": None,
    }


def _stage(compiled: Compiled, manifest: dict[str, Any]) -> Artifact:
    """The workdir laid out as a directory artifact (payload/ and checksums), for loading."""
    workdir, files = compiled.workdir, compiled.result.files
    entries = payload_entries(workdir, files)
    for name in files:
        dest = workdir / "payload" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(workdir / name, dest)
    return Artifact(workdir, {**manifest, "payload": entries})


def _verify_batches(request: Request, graph: Graph) -> list[dict[str, np.ndarray]] | None:
    """``verify_data`` read into checked batches, for a build that verifies at fp32/fp16/bf16
    on it (None otherwise: generated inputs, or int8's own gates)."""
    config = request.config
    if not config.verify or config.precision == Precision.INT8:
        return None
    return plan.verify_batches(request.quant.verify_data, graph.reference, config)


def _verify(
    engine: Engine,
    request: Request,
    checked: Checked,
    graph: Graph,
    data: list[dict[str, np.ndarray]] | None,
) -> dict[str, Any] | None:
    """The engine checked against its reference: accuracy gates on data for int8, otherwise
    ONNX Runtime CPU under ``config.verification`` (the scaled rule by default) on generated
    inputs or ``verify_data``. Returns the report (None when verify is off).

    Raises:
        VerificationError: the engine failed (it is closed first).
    """
    config = request.config
    if not config.verify:
        return None
    if config.precision == Precision.INT8:
        report = plan.verify(engine, checked.model, config, graph.quantized, request.quant)
        failure = (
            f"the int8 {config.backend} engine fails its accuracy gates on {report['data']}: "
            + "; ".join(report["failures"])
        )
    else:
        with step("verifying against ONNX Runtime CPU"):
            report = verify_engine(engine, graph.reference, config, data)
        tol = config.verification
        limits = (
            f"rtol={tol.rtol} of each output's scale max|ref| (atol={tol.atol}), cosine >= "
            f"{tol.min_cosine}"
            if tol.rule == "scaled"
            else f"atol={tol.atol}, rtol={tol.rtol} per element"
        )
        failure = (
            f"the {config.backend} engine built from {_name(checked)} disagrees with the "
            f"reference (ONNX Runtime CPU) past the {tol.rule} rule's {limits}: "
            f"{summarize(report)}"
        )
    if not report["passed"]:
        engine.close()
        raise VerificationError(failure, report)
    return report


def _write(
    engine: Engine, manifest: dict[str, Any], compiled: Compiled, output: str | os.PathLike | None
) -> Engine:
    """Write the artifact (when asked) and give the engine its final manifest."""
    workdir = compiled.workdir
    artifact = Artifact(workdir, manifest)
    if output is not None:
        with step(f"writing {output}"):
            written = write_artifact(output, manifest, workdir / "payload", compiled.result.files)
        artifact = open_artifact(written)
        manifest = artifact.manifest
    engine.manifest = manifest
    engine.artifact = artifact
    # The engine may map payload files (native libraries): keep them until it is gone.
    weakref.finalize(engine, shutil.rmtree, workdir, True)
    return engine


# -- cross-compiled builds ---------------------------------------------------------------------


class _CrossCompiled(Engine):
    """The engine of a cross-compiled build: it describes the artifact but cannot run here."""

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        raise EnginekitError(
            f"this engine was cross-compiled ({self.manifest['backend']['metadata']['cross_compiled']}); "
            "copy its artifact to a host of its target and enginekit.load it there"
        )


def _write_unloaded(
    manifest: dict[str, Any], compiled: Compiled, output: str | os.PathLike | None
) -> Engine:
    """Write a payload that cannot run here; the returned engine only describes it."""
    why = compiled.cross_compiled
    if output is None:
        raise BuildError(
            f"the build targets another host ({why}) and cannot run here: pass output= to "
            "write the artifact"
        )
    log.warning("cross-compiled build (%s): written without loading or verifying it", why)
    with step(f"writing {output}"):
        written = write_artifact(output, manifest, compiled.workdir, compiled.result.files)
    shutil.rmtree(compiled.workdir, ignore_errors=True)
    spec = open_artifact(written).manifest
    return _CrossCompiled(
        [TensorSpec.from_json(s) for s in spec["inputs"]],
        [TensorSpec.from_json(s) for s in spec["outputs"]],
        BuildConfig.from_json(spec["config"]).profiles,
        spec,
    )


# -- helpers -----------------------------------------------------------------------------------


def _name(checked: Checked) -> str:
    return checked.model.label


def _what(checked: Checked, config: BuildConfig) -> str:
    return f"{_name(checked)} on {config.backend}"


def _toolchain() -> dict[str, str]:
    """Versions besides enginekit's and the backend's that shape an artifact (for rebuilds)."""
    import numpy
    import onnx

    return {"onnx": onnx.__version__, "numpy": numpy.__version__}
