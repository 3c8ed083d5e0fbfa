"""ONNX Runtime's TensorRT and CUDA execution providers on a real GPU (onnxruntime-gpu).

Skipped wherever ONNX Runtime lacks the provider or there is no CUDA device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import enginekit as ek
from enginekit import backends

sys.path.insert(0, str(Path(__file__).parent.parent / "backends" / "trt"))
import trt_models


def _providers() -> list[str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


HAS_CUDA = "cuda" in backends.availability("onnxruntime").devices
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for ONNX Runtime (onnxruntime-gpu)"),
]
needs_trt_ep = pytest.mark.skipif(
    "TensorrtExecutionProvider" not in _providers(),
    reason="this ONNX Runtime has no TensorrtExecutionProvider",
)
PROFILES = [{"x": [(1, 16), (8, 16), (32, 16)]}, {"x": [(33, 16), (64, 16), (128, 16)]}]


def reference(feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(
        trt_models.mlp().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]


def test_cuda_provider_matches_the_cpu_reference(tmp_path):
    engine = ek.build(
        trt_models.mlp(), shapes=PROFILES, device="cuda", output=tmp_path / "cuda.ekit"
    )
    feeds = {"x": np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)}
    assert "CUDAExecutionProvider" in engine.providers
    np.testing.assert_allclose(engine.infer(feeds)["y"], reference(feeds), atol=1e-4, rtol=1e-3)


@needs_trt_ep
def test_tensorrt_provider_caches_its_engines_in_the_artifact(tmp_path):
    out = tmp_path / "trt-ep.ekit"
    engine = ek.build(
        trt_models.mlp(), shapes=PROFILES, device="cuda", output=out,
        providers=["tensorrt", "cuda"],
    )  # fmt: skip
    cached = [n for n in engine.manifest["payload"] if n.startswith("trt_cache/")]
    assert any(n.endswith(".engine") for n in cached), cached
    feeds = {"x": np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)}
    with ek.load(out) as loaded:
        assert loaded.providers[0] == "TensorrtExecutionProvider"
        np.testing.assert_allclose(loaded.infer(feeds)["y"], reference(feeds), atol=1e-3, rtol=1e-3)
