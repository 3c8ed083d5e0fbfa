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

from typing import Any

from enginekit.backends import Availability, load
from enginekit.batcher import Batcher
from enginekit.build import STRATEGIES, build
from enginekit.calibration import CalibrationTable, calibrate
from enginekit.calibration.search import AccuracyTarget
from enginekit.config import BuildConfig, Precision, ShapeProfile, parse_shapes
from enginekit.dataset import ImagePreprocess, InferSummary, infer_dataset
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
from enginekit.evaluate.bench import bench
from enginekit.evaluate.candidates import Candidate
from enginekit.evaluate.choose import build_auto
from enginekit.evaluate.compare import compare
from enginekit.evaluate.profile import ProfileReport, profile
from enginekit.evaluate.report import BenchResult, CompareReport
from enginekit.export import export
from enginekit.model import Model, load_model
from enginekit.passes import lint_batch, make_batch_dynamic
from enginekit.version import __version__

# build() knows no strategy itself: the layers above it plug theirs in here.
STRATEGIES["auto"] = build_auto
del STRATEGIES, build_auto


def available_backends() -> list[Availability]:
    """Every registered backend with its availability here (installed, version, devices, why not)."""
    from enginekit import backends as registry

    return [registry.availability(n) for n in registry.names()]


def __getattr__(name: str) -> Any:
    # ek.ray imports Ray (an extra, and slow to import): only when first used.
    if name == "ray":
        import importlib

        module = importlib.import_module("enginekit.dataset.ray")
        globals()["ray"] = module
        return module
    raise AttributeError(f"module 'enginekit' has no attribute {name!r}")


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
