"""Reshapes over symbolic dims legalized by dim groups (enginekit/backends/tvm/reshape.py):
injective kernels without symbolic divisions, fused with their transposes as in a static
module, and the reference result at any batch and sequence."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reference, save_graph

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def test_dims_are_matched_in_groups_of_provably_equal_size():
    from tvm import tirx

    from enginekit.backends.tvm.reshape import groups

    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    c = {k: tirx.const(k, "int64") for k in (1, 4, 32, 128)}
    # Heads split off the hidden dim, the batch and sequence carried over.
    assert groups([b, n, c[128]], [b, n, c[4], c[32]]) == [(0, 1, 0, 1), (1, 2, 1, 2), (2, 3, 2, 4)]
    # Batch and heads merged.
    assert groups([b, c[4], n, c[32]], [b * 4, n, c[32]]) == [
        (0, 2, 0, 1),
        (2, 3, 1, 2),
        (3, 4, 2, 3),
    ]
    # A trailing unit dim joins the last group.
    assert groups([b, n], [b, n, c[1]]) == [(0, 1, 0, 1), (1, 2, 1, 3)]
    # Sizes no group of neighbours matches: left to TVM's reshape.
    assert groups([b, n], [n, c[4]]) is None


def _heads(tmp_path):
    """``x [b, n, 128]`` split into 4 heads of 32, heads before the sequence, scaled, and all
    rows flattened: ``[b * 4 * n, 32]``."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Reshape", ["x", "split"], ["h"]),
        helper.make_node("Transpose", ["h"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["t", "two"], ["m"]),
        helper.make_node("Reshape", ["m", "flat"], ["y"]),
    ]
    init = [
        numpy_helper.from_array(np.array([0, 0, 4, 32], np.int64), "split"),
        numpy_helper.from_array(np.array([-1, 32], np.int64), "flat"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
    ]
    spec = {"x": (TensorProto.FLOAT, ["b", "n", 128])}
    return save_graph(tmp_path, nodes, spec, {"y": TensorProto.FLOAT}, 17, init)


def test_a_head_split_over_a_symbolic_sequence_fuses_with_its_transpose(tmp_path):
    # TVM's own reshape read x[(b * n + s) // n, (b * n + s) % n, ...]: opaque to fusion, a
    # kernel of its own (the small BERT without static shapes: 59 kernel calls, static 34).
    from enginekit.backends.tvm import frontend, lower

    target = lower.resolve_target(None, "cpu")
    model = ek.load_model(_heads(tmp_path))
    _, fused, _ = lower.optimize(frontend.import_onnx(model), target, "NHWC")
    kernels = {
        gv.name_hint: f.script() for gv, f in fused.functions_items() if gv.name_hint != "main"
    }
    head = [name for name in kernels if name.startswith("fused_reshape_transpose")]
    assert head, sorted(kernels)
    assert "// n" not in kernels[head[0]] and "% n" not in kernels[head[0]]


def test_a_reshape_over_symbolic_dims_gives_the_reference_result(tmp_path):
    path = _heads(tmp_path)
    shapes = {"x": [(1, 1, 128), (4, 24, 128), (4, 24, 128)]}
    rng = np.random.default_rng(0)
    with ek.build(path, backend="tvm", shapes=shapes, specialize=False) as engine:
        for batch, seq in ((1, 1), (2, 5), (3, 24)):
            feeds = {"x": rng.standard_normal((batch, seq, 128)).astype(np.float32)}
            np.testing.assert_array_equal(engine.infer(feeds)["y"], reference(path, feeds)["y"])
