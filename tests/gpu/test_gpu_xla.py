"""The XLA backend on JAX's CUDA plugin: conformance models and two corpus models (ResNet-50,
BERT), fp32 and bf16, against ONNX Runtime CPU.

Skipped where jax sees no GPU (no CUDA plugin, or no device). The GPU image's jax and plugin
versions differ from our pins: ``tests/gpu/run.sh`` prints which are installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from models import CASES

from enginekit import backends

sys.path.insert(0, str(Path(__file__).parent))
import xla_gpu

HAS_GPU = "cuda" in backends.availability("xla").devices
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_GPU,
        reason=f"jax sees no GPU for the XLA backend: {xla_gpu.jax_summary().get('gpu', '?')}",
    ),
]
PRECISIONS = ("fp32", "bf16")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_xla_conformance_model_matches_onnxruntime_cpu(case, precision, onnx_model, tmp_path):
    spec = CASES[case]
    batches = (1, 3, spec.max_batch, spec.max_batch + 3)
    report = xla_gpu.check(
        case, onnx_model(case), spec.shapes, spec.feeds, batches, "cuda", precision, tmp_path
    )
    print(f"\n[xla cuda] {report}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", xla_gpu.CORPUS_MODELS)
def test_gpu_xla_corpus_model_matches_onnxruntime_cpu(model, precision, tmp_path):
    pytest.importorskip("torch", reason="the corpus models are exported from PyTorch")
    try:
        path, shapes, feeds = xla_gpu.corpus_model(model, tmp_path)
    except ModuleNotFoundError as exc:
        pytest.skip(f"{model} needs {exc.name}")
    report = xla_gpu.check(model, path, shapes, feeds, (1, 5, 8), "cuda", precision, tmp_path)
    print(f"\n[xla cuda] {report}")
