"""benchmarks/backends.py: the FLOP count from the ONNX graph matches a hand count."""

from __future__ import annotations

import importlib.util

import pytest
from compare_helpers import ROOT


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "bench_backends", ROOT / "benchmarks" / "backends.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resnet_style_flops_match_a_hand_count_and_scale_with_batch(script):
    model = script.resnet_style(64, classes=100)
    one = script.count_flops(model, {"x": (1, 3, 64, 64)})
    stem = 2 * (32 * 32 * 32) * (3 * 9)
    stage1 = 4 * 2 * (32 * 32 * 32) * (32 * 9)
    stage2 = 2 * 64 * 16 * 16 * (32 * 9 + 64 * 9 + 32 + 2 * 64 * 9)
    stage3 = 2 * 128 * 8 * 8 * (64 * 9 + 128 * 9 + 64 + 2 * 128 * 9)
    gemm = 2 * 128 * 100
    assert one == stem + stage1 + stage2 + stage3 + gemm
    assert script.count_flops(model, {"x": (4, 3, 64, 64)}) == 4 * one


def test_backend_options_parse_per_backend(script):
    assert script.backend_options(["tvm.trials=64", "tvm.target=llvm", "xla.jit=true"]) == {
        "tvm": {"trials": 64, "target": "llvm"},
        "xla": {"jit": True},
    }


def test_no_benchmark_script_shadows_a_package_it_imports():
    # A script runs with benchmarks/ first on sys.path: benchmarks/tvm.py once made every other
    # script's `import tvm` load it instead of Apache TVM.
    for script in (ROOT / "benchmarks").glob("*.py"):
        spec = importlib.util.find_spec(script.stem)
        # Namespace packages (tests/backends under pytest) have no origin and shadow nothing.
        assert spec is None or spec.origin is None, f"{script.name} shadows {spec.origin}"
