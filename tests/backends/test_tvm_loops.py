"""ONNX ``Loop`` unrolled before import where its trip count is known and its condition
stays true (enginekit/backends/tvm/loops.py); other Loops refused naming op and node."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference, save_graph
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _loop_model(tmp_path, cond_out_op="Identity"):
    """y += x[i] for i < trip_count, each partial sum also a scan output (onnx's loop11)."""
    x = onnx.numpy_helper.from_array(np.array([1, 2, 3, 4, 5], np.float32), "x")
    one = onnx.numpy_helper.from_array(np.array(1, np.int64), "one")
    zero = onnx.numpy_helper.from_array(np.array([0], np.int64), "zero")
    body = helper.make_graph(
        [
            helper.make_node(cond_out_op, ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["i", "one"], ["end"]),
            helper.make_node("Unsqueeze", ["i", "zero"], ["start1"]),
            helper.make_node("Unsqueeze", ["end", "zero"], ["end1"]),
            helper.make_node("Slice", ["x", "start1", "end1"], ["xi"]),
            helper.make_node("Add", ["y_in", "xi"], ["y_out"]),
            helper.make_node("Identity", ["y_out"], ["scan"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", I64, []),
            helper.make_tensor_value_info("cond_in", B, []),
            helper.make_tensor_value_info("y_in", F, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", B, []),
            helper.make_tensor_value_info("y_out", F, [1]),
            helper.make_tensor_value_info("scan", F, [1]),
        ],
    )
    node = helper.make_node(
        "Loop", ["trips", "cond", "y"], ["final", "partial"], body=body, name="loop"
    )
    inputs = {"trips": (I64, ()), "cond": (B, ()), "y": (F, (1,))}
    return save_graph(tmp_path, [node], inputs, {"final": F, "partial": F}, 17, [x, one, zero])


def test_a_loop_with_its_trip_count_fed_as_a_value_input_is_unrolled(tmp_path):
    # TVM 0.27 has no Loop converter ("cannot convert op 'Loop'"); ONNX's Range body is one.
    path = _loop_model(tmp_path)
    feeds = {"trips": np.array(4), "cond": np.array(True), "y": np.array([-2.0], np.float32)}
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with ek.build(path, backend="tvm", shapes=shapes, verify_data=feeds) as engine:
        got = engine.infer(feeds)
        want = reference(path, feeds)
        for name in ("final", "partial"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
        # Another trip count: a program compiled for it, the scan output one row longer.
        other = {**feeds, "trips": np.array(5)}
        np.testing.assert_allclose(
            engine.infer(other)["partial"], reference(path, other)["partial"]
        )


def test_a_loop_whose_body_computes_its_condition_is_refused_naming_op_and_node(tmp_path):
    path = _loop_model(tmp_path, cond_out_op="Not")
    feeds = {"trips": np.array(4), "cond": np.array(True), "y": np.array([-2.0], np.float32)}
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with pytest.raises(BuildError, match=r"op 'Loop' .*at node 'loop'"):
        ek.build(path, backend="tvm", shapes=shapes, verify_data=feeds)
