"""TVM value inputs: graph inputs whose values decide shapes are compiled in as constants, one
program per set of values (enginekit/backends/tvm/values.py).

Without values.py each of these models fails at build: TVM's Relax importer reads Reshape's
shape, Range's limits, TopK's k... as constants ("Reshape requires the input new shape to be
Shape"); ONNX's own test cases feed such operands as graph inputs like this.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import errors_in_threads, reference
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.artifact import open_artifact
from enginekit.errors import BuildError, EngineInputError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

from enginekit.backends import values as shared
from enginekit.backends.tvm import values


def _save(tmp: Path, name: str, nodes, inputs, outputs, inits=()) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _reshape(tmp: Path, elements: int = 2) -> Path:
    """y = Reshape(Relu(x), shape), shape a graph input."""
    return _save(
        tmp,
        "reshape_by_input",
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Reshape", ["r", "shape"], ["y"], name="by_input"),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [elements]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )


@pytest.fixture(scope="module")
def reshape_artifact(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("tvm-values")
    path = _reshape(tmp)
    out = tmp / "m.ekit"
    ek.build(path, backend="tvm", output=out, simplify=False).close()
    return path, out


def test_find_uses_tvm_table_and_the_importers_constant_inputs(tmp_path):
    path = _save(
        tmp_path,
        "reduce_by_input",
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum")],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    assert values.find(onnx.load(str(path))) == {"axes": "sum (ReduceSum) input 1"}
    assert values.find(onnx.load(str(_reshape(tmp_path)))) == {
        "shape": "by_input (Reshape) input 1"
    }


def test_every_input_the_importer_reads_as_a_constant_is_a_value_input():
    from enginekit.backends.tvm.frontend import _CONSTANT_INPUTS

    for op, held in _CONSTANT_INPUTS.items():
        assert set(held) <= set(shared.SHAPE_INPUTS.get(op, ())), op


def test_reshape_by_an_input_compiles_a_program_per_set_of_values(reshape_artifact):
    path, out = reshape_artifact
    artifact = open_artifact(out)
    meta = artifact.manifest["backend"]["metadata"]
    assert meta["value_inputs"]["inputs"] == {"shape": "by_input (Reshape) input 1"}
    (stored,) = meta["value_inputs"]["programs"]
    assert shared.from_json(stored["values"])["shape"].tolist() == [2, 6]
    assert "model.onnx" in artifact.manifest["payload"]
    assert artifact.manifest["verify"]["passed"]

    x = np.arange(12, dtype=np.float32).reshape(2, 6) - 5
    with ek.load(out) as engine:
        assert engine.value_inputs == ("shape",)
        assert engine.programs == ["shape=[2, 6]"]  # the build's, loaded from model.so
        for target in ([2, 6], [3, 4], [-1, 2], [3, 4]):
            feeds = {"x": x, "shape": np.array(target, np.int64)}
            np.testing.assert_array_equal(engine.infer(feeds)["y"], reference(path, feeds)["y"])
        # [3, 4] compiled once, came back from the cache the second time.
        assert engine.programs == ["shape=[2, 6]", "shape=[-1, 2]", "shape=[3, 4]"]
        with pytest.raises(EngineInputError, match=r"shape=\[5, 5\] does not compile"):
            engine.infer({"x": x, "shape": np.array([5, 5], np.int64)})


def test_program_cache_is_bounded(reshape_artifact):
    _, out = reshape_artifact
    x = np.ones((2, 6), np.float32)
    with ek.load(out) as engine:
        engine._programs.size = 2
        for target in ([3, 4], [4, 3], [6, 2]):
            assert engine.infer({"x": x, "shape": np.array(target, np.int64)})["y"].shape == (
                tuple(target)
            )
        assert engine.programs == ["shape=[4, 3]", "shape=[6, 2]"]


def test_concurrent_first_calls_with_new_values_compile_once(reshape_artifact):
    _, out = reshape_artifact
    feeds = {"x": np.ones((2, 6), np.float32), "shape": np.array([1, 12], np.int64)}
    with ek.load(out) as engine:

        def call() -> None:
            assert engine.infer(feeds)["y"].shape == (1, 12)

        assert not errors_in_threads(call)
        assert engine.programs == ["shape=[2, 6]", "shape=[1, 12]"]


def test_range_with_an_input_limit_matches_onnxruntime(tmp_path):
    path = _save(
        tmp_path,
        "range_by_input",
        [
            helper.make_node("Range", ["zero", "limit", "one"], ["r"]),
            helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["rf", "x"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info("limit", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ],
    )
    with ek.build(path, backend="tvm", simplify=False) as engine:
        assert engine.manifest["verify"]["passed"]
        for limit in (3, 7, 1):
            feeds = {"x": np.array([0.5], np.float32), "limit": np.array(limit, np.int64)}
            np.testing.assert_array_equal(engine.infer(feeds)["y"], reference(path, feeds)["y"])


def test_a_large_value_input_is_refused_with_its_size(tmp_path):
    path = _reshape(tmp_path, elements=2048)
    with pytest.raises(BuildError, match=r"'shape' feeds by_input \(Reshape\).*TVM.*up to 2048"):
        ek.build(path, backend="tvm", simplify=False, verify=False)


def test_profile_runs_the_program_for_the_values_given(reshape_artifact):
    from enginekit.backends import tvm as tvm_backend

    _, out = reshape_artifact
    feeds = {"x": np.ones((2, 6), np.float32), "shape": np.array([3, 4], np.int64)}
    events = tvm_backend.profile(open_artifact(out), feeds, runs=1, warmup=0)
    assert {e.op for e in events} >= {"relu"}


def test_an_empty_input_runs_whatever_its_pointer(tmp_path):
    """numpy gives an empty array zero strides; passed without a copy when its pointer
    happened to be 64-byte aligned, the kernel's stride check failed (ONNX's
    ``reduce_sum_empty_set``)."""
    from enginekit.backends.tvm.runtime import _ALIGN

    path = _save(
        tmp_path,
        "empty_sum",
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 0, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])],
    )
    buffer = np.zeros(2 * _ALIGN, np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    x = buffer[start : start + 4].view(np.float32)[:0].reshape(2, 0, 4)  # aligned, empty
    assert x.ctypes.data % _ALIGN == 0 and x.flags.writeable
    with ek.build(path, backend="tvm", simplify=False, verify=False) as engine:
        np.testing.assert_array_equal(engine.infer({"x": x})["y"], np.zeros((2, 1, 4)))


def test_verify_data_decides_the_program_compiled_at_build(tmp_path):
    """With verify_data, the build compiles the program verification runs (its values), not
    one for generated values and a second one for verification."""
    path = _reshape(tmp_path)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    data = {"x": x, "shape": np.array([3, 4], np.int64)}
    out = tmp_path / "m.ekit"
    with ek.build(path, backend="tvm", simplify=False, verify_data=data, output=out) as engine:
        assert engine.programs == ["shape=[3, 4]"]
    (stored,) = open_artifact(out).manifest["backend"]["metadata"]["value_inputs"]["programs"]
    assert shared.from_json(stored["values"])["shape"].tolist() == [3, 4]


def test_example_one_hot_depth_and_window_size_below_one_become_two():
    # Below 1 the output is empty, and TVM cannot load a library holding an empty constant
    # ("Invalid DLTensor file format"): the build's own program used to fail to load.
    from enginekit.backends.tvm.values import accepted

    nodes = [
        helper.make_node("OneHot", ["i", "depth", "v"], ["y"]),
        helper.make_node("HannWindow", ["n"], ["w"]),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    example = {"depth": np.array(0.5, np.float32), "n": np.array(0, np.int32)}
    out = accepted(helper.make_model(graph), example)
    assert out["depth"] == 2 and out["depth"].dtype == np.float32
    assert out["n"] == 2 and out["n"].dtype == np.int32
    assert accepted(helper.make_model(graph), {"depth": np.array(3.0, np.float32)})["depth"] == 3


def test_example_upsample_scales_tvm_refuses_become_ones():
    # Generated scales of 0s and 1s failed TVM's Upsample assertions at import, before
    # verification could ask for verify_data=.
    from enginekit.backends.tvm.values import accepted

    node = helper.make_node("Upsample", ["x", "s"], ["y"])
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    out = accepted(model, {"s": np.array([0, 1, 0, 1], np.float32)})
    np.testing.assert_array_equal(out["s"], np.ones(4, np.float32))
    kept = np.array([1, 1, 2, 3], np.float32)
    np.testing.assert_array_equal(accepted(model, {"s": kept})["s"], kept)
