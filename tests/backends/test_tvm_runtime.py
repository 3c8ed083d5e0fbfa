"""The TVM engine's runtime (enginekit/backends/tvm/runtime.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")


def test_a_scalar_input_stays_0d(tmp_path):
    # A 0-d array is not 64-byte aligned, so it is copied; np.ascontiguousarray made the copy
    # 1-d and the VM refused it ("expect Tensor with ndim 0 but get 1").
    graph = helper.make_graph(
        [helper.make_node("Pow", ["x", "y"], ["z"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, (3,)),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ()),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, (3,))],
    )
    path = tmp_path / "pow.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), path)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    with ek.build(path, backend="tvm", shapes={"x": [(3,)] * 3, "y": [()] * 3}) as engine:
        got = engine.infer({"x": x, "y": np.array(2.0, np.float32)})
    np.testing.assert_allclose(got["z"], x**2)


def test_an_empty_input_with_odd_strides_runs(tmp_path):
    # onnx's loader gives an empty array strides (0, 0, 0); passed zero-copy, the VM refused
    # it ("Mismatched x.strides").
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 0, 5))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (3, 0, 5))],
    )
    path = tmp_path / "empty.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), path)
    base = np.zeros(64, np.float32)
    start = (-base.ctypes.data % 64) // 4  # 64-byte aligned: the zero-copy path
    x = np.lib.stride_tricks.as_strided(base[start:], (3, 0, 5), (0, 0, 0))
    with ek.build(path, backend="tvm", shapes={"x": [(3, 0, 5)] * 3}) as engine:
        assert engine.infer({"x": x})["y"].shape == (3, 0, 5)
