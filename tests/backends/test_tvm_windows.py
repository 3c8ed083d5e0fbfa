"""enginekit's TVM converters for Col2Im and TensorScatter (enginekit/backends/tvm/windows.py),
which TVM 0.27's Relax importer has no converter for ("cannot convert op")."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import matches_reference, reference, save_graph
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.backends.tvm.windows import col2im_matrix

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def test_col2im_matrix_sums_overlapping_blocks():
    # A 1-D image of 4 from blocks of 2 at stride 1: the middle pixels are in two blocks.
    m = col2im_matrix([4], [2], [1], [0, 0], [1])
    assert m.shape == (2 * 3, 4)
    np.testing.assert_array_equal(m.sum(axis=0), [1, 2, 2, 1])


def test_col2im_and_tensor_scatter_convert(tmp_path):
    # Col2Im with pads, strides and dilations; TensorScatter linear and circular.
    init = [
        numpy_helper.from_array(np.array([5, 6], np.int64), "image"),
        numpy_helper.from_array(np.array([2, 2], np.int64), "block"),
    ]
    nodes = [
        helper.make_node(
            "Col2Im", ["cols", "image", "block"], ["img"],
            pads=[1, 0, 0, 1], strides=[2, 1], dilations=[1, 2],
        ),
        helper.make_node("TensorScatter", ["cache", "update", "at"], ["lin"]),
        helper.make_node("TensorScatter", ["cache", "update", "at"], ["circ"], mode="circular"),
    ]  # fmt: skip
    # Blocks: rows (5 + 1 - 2) // 2 + 1 = 3, columns (6 + 1 - 3) // 1 + 1 = 5.
    inputs = {
        "cols": (F, (1, 3 * 4, 15)),
        "cache": (F, (2, 2, 5, 3)),
        "update": (F, (2, 2, 2, 3)),
        "at": (I64, (2,)),
    }
    path = save_graph(tmp_path, nodes, inputs, {"img": F, "lin": F, "circ": F}, 24, init)
    rng = np.random.default_rng(0)
    feeds = {
        "cols": rng.standard_normal((1, 12, 15)).astype(np.float32),
        "cache": rng.standard_normal((2, 2, 5, 3)).astype(np.float32),
        "update": rng.standard_normal((2, 2, 2, 3)).astype(np.float32),
        "at": np.array([3, 1], np.int64),
    }
    matches_reference(path, feeds, "tvm", rtol=1e-5, atol=1e-6)


def test_col2im_shapes_from_graph_inputs_build(tmp_path):
    # The build's generated image_shape and block_shape (random 0/1 integers) fit no block,
    # so the build's own program failed to import before verification could ask for
    # verify_data; it is compiled for fitting values, the given ones at inference.
    node = helper.make_node("Col2Im", ["cols", "image", "block"], ["img"], pads=[1, 1, 1, 1])
    inputs = {"cols": (F, (1, 4, 20)), "image": (I64, (2,)), "block": (I64, (2,))}
    path = save_graph(tmp_path, [node], inputs, {"img": F}, 18)
    feeds = {
        "cols": np.random.default_rng(1).standard_normal((1, 4, 20)).astype(np.float32),
        "image": np.array([3, 4], np.int64),
        "block": np.array([2, 2], np.int64),
    }
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with ek.build(path, backend="tvm", shapes=shapes, verify_data=feeds) as engine:
        got = engine.infer(feeds)["img"]
    np.testing.assert_allclose(got, reference(path, feeds)["img"], rtol=1e-5, atol=1e-6)
