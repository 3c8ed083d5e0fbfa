"""enginekit: turn a trained model into a fast, verified inference engine on any backend.

import enginekit as ek
ek.export(torch_model, (x,), "model.onnx", dynamic_batch=True)
engine = ek.build("model.onnx", shapes={"x": [(1, 16), (8, 16), (64, 16)]}, output="m.ekit")
engine = ek.load("m.ekit")
outputs = engine.infer({"x": x})
table = ek.calibrate("model.onnx", calib_x)                      # INT8 ranges, on CPU
engine8 = ek.build("model.onnx", precision="int8", calibration=table, verify_data=val_x)
report = ek.compare("model.onnx", backends=["onnxruntime"], shapes=...)  # report.passed gates CI
result = ek.bench(engine, batch_sizes=[1, 8, 32], duration=5.0)
with ek.Batcher(engine, max_delay_ms=2.0) as batcher:          # many small requests, full batches
    row = batcher.infer(x[0])                                    # or submit() / await infer_async()
summary = ek.infer_dataset("m.ekit", "data.parquet", "preds/")    # resumable batch inference
ds = ek.ray.map_engine(ray_dataset, "m.ekit")                      # the same on Ray Data
print(ek.profile(engine, batch=8).table())                     # per-op times, GFLOP/s vs peak
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# The light part of the API, imported with the package.
from enginekit.backends import Availability, load
from enginekit.config import BuildConfig, Precision, ShapeProfile, parse_shapes
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import (
    ArtifactError,
    BackendUnavailable,
    BatcherClosed,
    BatcherError,
    BuildError,
    CalibrationError,
    DatasetError,
    DeadlineExceeded,
    EngineInputError,
    EnginekitError,
    ExportError,
    ModelError,
    QueueFull,
    UsageError,
    VerificationError,
)
from enginekit.export import export
from enginekit.version import __version__

if TYPE_CHECKING:
    from enginekit.batcher import Batcher
    from enginekit.build import build
    from enginekit.calibration import CalibrationTable, calibrate
    from enginekit.calibration.search import AccuracyTarget
    from enginekit.dataset import ImagePreprocess, InferSummary, infer_dataset
    from enginekit.evaluate.bench import bench
    from enginekit.evaluate.candidates import Candidate
    from enginekit.evaluate.compare import compare
    from enginekit.evaluate.profile import ProfileReport, profile
    from enginekit.evaluate.report import BenchResult, CompareReport
    from enginekit.model import Model, load_model
    from enginekit.passes import lint_batch, make_batch_dynamic

# The rest is imported on first use (ek.build, ek.Batcher, ...): a process that needs only part
# of the package, such as a Ray Data actor (it imports enginekit.dataset.ray and a backend in
# every new worker process of every job), does not pay for building, calibrating, batching and
# evaluating on each start.
_LAZY = {
    "AccuracyTarget": "enginekit.calibration.search",
    "Batcher": "enginekit.batcher",
    "BenchResult": "enginekit.evaluate.report",
    "CalibrationTable": "enginekit.calibration",
    "Candidate": "enginekit.evaluate.candidates",
    "CompareReport": "enginekit.evaluate.report",
    "ImagePreprocess": "enginekit.dataset",
    "InferSummary": "enginekit.dataset",
    "Model": "enginekit.model",
    "ProfileReport": "enginekit.evaluate.profile",
    "bench": "enginekit.evaluate.bench",
    "build": "enginekit.build",
    "calibrate": "enginekit.calibration",
    "compare": "enginekit.evaluate.compare",
    "infer_dataset": "enginekit.dataset",
    "lint_batch": "enginekit.passes",
    "load_model": "enginekit.model",
    "make_batch_dynamic": "enginekit.passes",
    "profile": "enginekit.evaluate.profile",
}


def available_backends() -> list[Availability]:
    """Every registered backend with its availability here (installed, version, devices, why not)."""
    from enginekit import backends as registry

    return [registry.availability(n) for n in registry.names()]


def __getattr__(name: str) -> Any:
    if name == "ray":  # ek.ray imports Ray (an extra, and slow to import)
        value: Any = importlib.import_module("enginekit.dataset.ray")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'enginekit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package's module type. The import system binds a submodule on its package when it
    first imports it; for ``enginekit.build`` (from anywhere) this is where the layers above
    build plug in their strategies (build() knows none itself), and ``ek.build`` stays the
    function, not the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "build" and isinstance(value, types.ModuleType):
            # Registered without importing the strategy's module now: enginekit.build may be
            # bound while enginekit.evaluate.choose (which imports it) is half initialized.
            value.STRATEGIES.setdefault("auto", _build_auto)
            return
        super().__setattr__(name, value)


def _build_auto(*args: Any, **kwargs: Any) -> Any:
    """``backend="auto"``: :func:`enginekit.evaluate.choose.build_auto`, imported when used."""
    from enginekit.evaluate.choose import build_auto

    return build_auto(*args, **kwargs)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "AccuracyTarget",
    "ArtifactError",
    "Availability",
    "BackendUnavailable",
    "Batcher",
    "BatcherClosed",
    "BatcherError",
    "BenchResult",
    "BuildConfig",
    "BuildError",
    "CalibrationError",
    "CalibrationTable",
    "Candidate",
    "CompareReport",
    "DatasetError",
    "DeadlineExceeded",
    "Engine",
    "EngineInputError",
    "EnginekitError",
    "ExportError",
    "ImagePreprocess",
    "InferSummary",
    "Model",
    "ModelError",
    "Precision",
    "ProfileReport",
    "QueueFull",
    "ShapeProfile",
    "TensorSpec",
    "UsageError",
    "VerificationError",
    "__version__",
    "available_backends",
    "bench",
    "build",
    "calibrate",
    "compare",
    "export",
    "infer_dataset",
    "lint_batch",
    "load",
    "load_model",
    "make_batch_dynamic",
    "parse_shapes",
    "profile",
]
