"""TVM backend bf16: conv/matmul operands in bfloat16 with float32 accumulation, built only for
targets with AVX512-BF16, verified at the bf16 tolerance."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit import target as host
from enginekit.errors import BuildError

tvm = pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

SHAPES = {"x": [(1, 3, 6, 6), (2, 3, 6, 6), (2, 3, 6, 6)]}
BF16_CPU = {"kind": "llvm", "mcpu": "znver4"}


@pytest.fixture(scope="module")
def conv_mlp(tmp_path_factory):
    """conv + bias + relu, flatten, matmul: one conv2d and one matmul to cast."""
    rng = np.random.default_rng(0)
    inits = {
        "w": (0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32),
        "b": rng.standard_normal((1, 8, 1, 1)).astype(np.float32),
        "m": (0.1 * rng.standard_normal((8 * 6 * 6, 16))).astype(np.float32),
        "flat": np.array([0, -1], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "b"], ["cb"]),
        helper.make_node("Relu", ["cb"], ["r"]),
        helper.make_node("Reshape", ["r", "flat"], ["f"]),
        helper.make_node("MatMul", ["f", "m"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    path = tmp_path_factory.mktemp("bf16") / "conv_mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_bf16_casts_conv_and_matmul_operands_and_accumulates_in_fp32(conv_mlp):
    # Run at the Relax level on this host's target (bf16 is then emulated, which the backend
    # refuses for speed, not for correctness): the numbers are bf16's, within its tolerance.
    from tvm import relax

    from enginekit.backends.tvm import frontend, lower, precision

    target = lower.resolve_target(None, "cpu")
    mod = frontend.import_onnx(ek.load_model(conv_mlp))
    graph, fused, _ = lower.optimize(mod, target, "NHWC", "bf16")
    assert precision.count_casts(graph) == 2
    vm = relax.VirtualMachine(
        lower.compile_module(lower.apply_schedules(fused, target, "enginekit")[0], target),
        tvm.cpu(),
    )
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    want = reference(conv_mlp, {"x": x})["y"]
    scaled = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < scaled < 6e-2  # rounded like bf16 (fp32 would be ~1e-7), within its rtol


def test_bf16_is_refused_for_a_cpu_without_avx512_bf16(conv_mlp):
    with pytest.raises(BuildError, match=r"AVX512-BF16.*'znver3' has none.*znver4"):
        ek.build(
            conv_mlp,
            backend="tvm",
            shapes=SHAPES,
            precision="bf16",
            target={"kind": "llvm", "mcpu": "znver3"},
        )


def test_bf16_builds_for_a_bf16_cpu_and_records_the_cast_ops(conv_mlp, tmp_path):
    # On a host without BF16 this is a cross-compile (written, not run); on one with it, the
    # build is verified against ONNX Runtime at the bf16 tolerance.
    out = tmp_path / "bf16.ekit"
    engine = ek.build(
        conv_mlp, backend="tvm", shapes=SHAPES, precision="bf16", target=BF16_CPU, output=out
    )
    with engine:
        meta = engine.manifest["backend"]["metadata"]
        assert meta["precision"] == "bf16" and meta["bf16_ops"] == 2
        if "avx512_bf16" in host.cpu_flags():
            assert meta["cross_compiled"] is None
        else:
            assert "avx512_bf16" in meta["cross_compiled"]


@pytest.mark.skipif(
    "avx512_bf16" not in host.cpu_flags(), reason="this host's CPU has no AVX512-BF16"
)
def test_bf16_on_this_host_builds_verified_and_matches_fp32(conv_mlp):
    with ek.build(conv_mlp, backend="tvm", shapes=SHAPES, precision="bf16") as engine:
        assert engine.manifest["backend"]["metadata"]["bf16_ops"] == 2
        x = {"x": np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)}
        want = reference(conv_mlp, x)["y"]
        got = engine.infer(x)["y"]
        assert np.abs(got - want).max() <= 6e-2 * np.abs(want).max()
