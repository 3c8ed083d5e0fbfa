"""``If`` nodes whose condition is known before import become the branch they take
(enginekit/backends/tvm/branches.py), and a value input's generated build values that TVM
cannot compile ask for ``verify_data=``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference, save_graph
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F = TensorProto.FLOAT


def _build_and_compare(path, feeds, **kwargs):
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with ek.build(path, backend="tvm", shapes=shapes, **kwargs) as engine:
        got = engine.infer(feeds)
    for name, want in reference(path, feeds).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_if_on_a_static_rank_takes_one_branch_of_another_rank(tmp_path):
    # TVM converted both branches, the Shape a run-time shape it could not compare ("cannot
    # handle ShapeExpr inputs"); ONNX's AffineGrid body branches on its size's rank this way.
    axes = onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")
    two = onnx.numpy_helper.from_array(np.array(2, np.int64), "two")
    then = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", F, None)],
    )  # fmt: skip
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", F, None)],
    )  # fmt: skip
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Size", ["shape"], ["rank"]),
        helper.make_node("Equal", ["rank", "two"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    path = save_graph(tmp_path, nodes, {"x": (F, (2, 3))}, {"y": F}, 17, [axes, two])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    _build_and_compare(path, {"x": x}, simplify=False)


def test_unsqueeze_by_a_scalar_axis(tmp_path):
    # ONNX Runtime takes a 0-d axes; TVM iterated over it ("'int' object is not iterable").
    minus_one = onnx.numpy_helper.from_array(np.array(-1, np.int64), "minus_one")
    nodes = [
        helper.make_node("Unsqueeze", ["x", "minus_one"], ["u"]),
        helper.make_node("Relu", ["u"], ["r"]),
    ]
    path = save_graph(tmp_path, nodes, {"x": (F, (2, 3))}, {"u": F, "r": F}, 17, [minus_one])
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    _build_and_compare(path, {"x": x}, simplify=False)


def _expanded_affine_grid(tmp_path):
    """AffineGrid replaced by its ONNX function body (onnx's ``*_expanded`` test models)."""
    from enginekit.backends.tvm.expand import expand_functions
    from enginekit.backends.tvm.frontend import supported_ops

    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=0)
    inputs = {"theta": (F, (2, 2, 3)), "size": (TensorProto.INT64, (4,))}
    path = save_graph(tmp_path, [node], inputs, {"grid": F}, 20)
    proto, expanded = expand_functions(onnx.load(path), set(supported_ops()) - {"AffineGrid"})
    assert expanded == ["AffineGrid"]
    onnx.save(proto, path)
    return path


def test_generated_values_tvm_cannot_compile_ask_for_verify_data(tmp_path):
    # The generated size (zeros and ones) makes an empty grid ONNX Runtime runs but TVM's
    # import of the body failed on ("Index 3 out of bounds 3"): the error now asks for
    # verify_data, and with it the body (If on the size's rank, Unsqueeze by -1) builds.
    path = _expanded_affine_grid(tmp_path)
    theta = np.random.default_rng(0).standard_normal((2, 2, 3)).astype(np.float32)
    feeds = {"theta": theta, "size": np.array([2, 3, 4, 5], np.int64)}
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with pytest.raises(BuildError, match=r"generated values.*pass verify_data="):
        ek.build(path, backend="tvm", shapes=shapes).close()
    _build_and_compare(path, feeds, verify_data=feeds)
