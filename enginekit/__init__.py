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
print(ek.profile(engine, batch=8).table())                     # per-op times, GFLOP/s vs peak
"""

from __future__ import annotations

from enginekit.backends import Availability, load
from enginekit.build import STRATEGIES, build
from enginekit.calibration import CalibrationTable, calibrate
from enginekit.config import BuildConfig, Precision, ShapeProfile, parse_shapes
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import (
    ArtifactError,
    BackendUnavailable,
    BuildError,
    CalibrationError,
    EngineInputError,
    EnginekitError,
    ExportError,
    ModelError,
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


__all__ = [
    "ArtifactError",
    "Availability",
    "BackendUnavailable",
    "BenchResult",
    "BuildConfig",
    "BuildError",
    "CalibrationError",
    "CalibrationTable",
    "Candidate",
    "CompareReport",
    "Engine",
    "EngineInputError",
    "EnginekitError",
    "ExportError",
    "Model",
    "ModelError",
    "Precision",
    "ProfileReport",
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
    "lint_batch",
    "load",
    "load_model",
    "make_batch_dynamic",
    "parse_shapes",
    "profile",
]
