"""The CPU-side parts of the XLA GPU checks (tests/gpu/xla_gpu.py), run on the CPU device."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_loader import load_script

pytest.importorskip("jax", reason="the XLA backend needs jax")

from models import CASES

GPU_DIR = Path(__file__).resolve().parents[2] / "gpu"


@pytest.fixture(scope="module")
def xla_gpu():
    return load_script(GPU_DIR / "xla_gpu.py", "xla_gpu")


def test_jax_summary_names_jax_and_its_devices(xla_gpu):
    import jax

    summary = xla_gpu.jax_summary()
    assert summary["jax"] == jax.__version__
    assert any("cpu" in d.lower() for d in summary["devices"])
    assert "gpu" in summary


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_check_builds_reloads_and_compares_a_conformance_model(
    xla_gpu, precision, onnx_model, tmp_path
):
    spec = CASES["mlp"]
    report = xla_gpu.check(
        "mlp", onnx_model("mlp"), spec.shapes, spec.feeds, (1, 19), "cpu", precision, tmp_path
    )
    import onnx

    outputs = {o.name for o in onnx.load(str(onnx_model("mlp"))).graph.output}
    assert report.batches == (1, 19)
    assert set(report.worst) == outputs
    assert all(0 <= e < (1e-3 if precision == "fp32" else 5e-2) for e in report.worst.values())


@pytest.mark.slow
def test_corpus_model_check_runs_on_the_cpu_device(xla_gpu, tmp_path):
    """The GPU run's corpus path (prepare an entry, build, reload, compare), on a tiny BERT."""
    pytest.importorskip("torch", reason="the corpus models are exported from PyTorch")
    pytest.importorskip("transformers")
    path, shapes, feeds = xla_gpu.corpus_model("hf-bert", tmp_path)
    report = xla_gpu.check("hf-bert", path, shapes, feeds, (1, 5), "cpu", "fp32", tmp_path)
    assert report.batches == (1, 5) and all(e < 1e-4 for e in report.worst.values())
