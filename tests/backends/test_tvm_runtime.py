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


def test_staged_inputs_are_reused_and_an_output_aliasing_one_is_copied(tmp_path):
    # An input TVM cannot take as it is (not 64-byte aligned, read-only, strided) is copied
    # into a staging tensor reused by the next call of that shape; an output that is that
    # tensor (Identity) or a view of it (Reshape) must not change when the next call runs.
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["same"]),
            helper.make_node("Reshape", ["x", "flat"], ["reshaped"]),
            helper.make_node("Add", ["x", "x"], ["twice"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ("batch", 4))],
        [
            helper.make_tensor_value_info("same", TensorProto.FLOAT, ("batch", 4)),
            helper.make_tensor_value_info("reshaped", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("twice", TensorProto.FLOAT, ("batch", 4)),
        ],
        [helper.make_tensor("flat", TensorProto.INT64, (1,), [-1])],
    )
    path = tmp_path / "alias.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    base = np.arange(12, dtype=np.float32)
    first, second = base[1:9].reshape(2, 4), base[2:10].reshape(2, 4)  # 4-byte offsets
    with ek.build(path, backend="tvm", shapes={"x": [(1, 4), (2, 4), (4, 4)]}) as engine:
        got = engine.infer({"x": first})
        engine.infer({"x": second})
        first.flags.writeable = False  # read-only: staged too
        again = engine.infer({"x": first})
        strided = engine.infer({"x": base[:8].reshape(4, 2).T.copy(order="F")})
    np.testing.assert_array_equal(got["same"], base[1:9].reshape(2, 4))
    np.testing.assert_array_equal(got["reshaped"], base[1:9])
    np.testing.assert_array_equal(got["twice"], 2 * base[1:9].reshape(2, 4))
    np.testing.assert_array_equal(again["same"], base[1:9].reshape(2, 4))
    np.testing.assert_array_equal(strided["same"], base[:8].reshape(4, 2).T)


def test_tvm_threads_default_to_the_physical_cores_unless_chosen(monkeypatch):
    # TVM alone takes half the logical CPUs on x86: one thread on a 2-core host without SMT.
    import os

    from enginekit.backends.tvm.runtime import configure_threads
    from enginekit.target import physical_cores

    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):  # recorded, so undone after the test
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    configure_threads()

    assert os.environ["TVM_NUM_THREADS"] == str(physical_cores())
    assert 1 <= physical_cores() <= (os.cpu_count() or 1)
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    configure_threads()
    assert os.environ["TVM_NUM_THREADS"] == "3"
    monkeypatch.delenv("TVM_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    configure_threads()
    assert "TVM_NUM_THREADS" not in os.environ
