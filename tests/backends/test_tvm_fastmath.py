"""Vectorizable erf, tanh and GELU on TVM CPU builds (enginekit/backends/tvm/fastmath.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import matches_reference, reference, save_graph

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def _model(tmp_path):
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Erf", ["x"], ["e"]),
        helper.make_node("Tanh", ["x"], ["t"]),
        helper.make_node("Gelu", ["x"], ["g"]),
        helper.make_node("Gelu", ["x"], ["h"], approximate="tanh"),
    ]
    outputs = dict.fromkeys("ethg", TensorProto.FLOAT)
    return save_graph(tmp_path, nodes, {"x": (TensorProto.FLOAT, [4, 64])}, outputs, 20)


def test_erf_tanh_and_gelu_kernels_call_no_libm_function(tmp_path):
    # libm's erff / tanh per element cost GELU more than its matmul (27.7 vs 0.45 ns per
    # element): the kernels must compute TVM's polynomial approximations instead.
    from tvm import tirx

    from enginekit.backends.tvm import frontend, lower

    target = lower.resolve_target(None, "cpu")
    _, fused, _ = lower.optimize(
        frontend.import_onnx(ek.load_model(_model(tmp_path))), target, "NCHW"
    )
    kernels = [f.script() for _gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert kernels
    for script in kernels:
        assert "T.erf(" not in script and "T.tanh(" not in script, script


def test_the_approximations_give_the_reference_result(tmp_path):
    x = np.random.default_rng(0).uniform(-6, 6, (4, 64)).astype(np.float32)
    matches_reference(_model(tmp_path), {"x": x}, "tvm", rtol=1e-5, atol=1e-6)


def test_softmax_with_fast_exp_is_exact_at_masked_and_all_masked_rows(tmp_path):
    # fast_exp clamps its argument: a masked position (-inf, float32's lowest) must still give
    # 0 and a row masked entirely NaN, as exp does. (On x86 fast_exp alone passes this too:
    # its clamp lets NaN through and exp(-88.4) is below atol; the guard does not rely on it.)
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    spec = (TensorProto.FLOAT, ["b", "n"])
    path = save_graph(tmp_path, nodes, {"x": spec}, {"y": TensorProto.FLOAT}, 13)
    x = np.random.default_rng(0).uniform(-20, 20, (4, 37)).astype(np.float32)
    x[0, :5] = -np.inf
    x[1, 3:] = np.finfo(np.float32).min
    x[2, :] = -np.inf
    with ek.build(path, backend="tvm", shapes={"x": [(1, 1), (4, 64), (4, 64)]}) as engine:
        got = engine.infer({"x": x})["y"]
    want = reference(path, {"x": x})["y"]
    assert np.isnan(want[2]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
