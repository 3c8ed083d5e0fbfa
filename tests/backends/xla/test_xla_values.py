"""Value inputs: graph inputs whose values decide shapes get programs specialized to them.

Without values.py each of these models is refused at build ("Reshape's shape must be known
when the model is built"); ONNX's own test cases feed Reshape/Expand/Tile/Range/Resize/TopK/
Slice operands as graph inputs like this.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

import xla_graphs as graphs
from conftest import errors_in_threads, reference
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.artifact import open_artifact
from enginekit.backends.xla import values
from enginekit.errors import BuildError, EngineInputError


def _reshape_model():
    return graphs.reshape_by_input()


def _range_model():
    """y = Range(0, limit, 1) * scale, limit an int64 scalar input; plus x passed through."""
    nodes = [
        helper.make_node("Range", ["zero", "limit", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["rf", "x"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
        helper.make_tensor_value_info("limit", TensorProto.INT64, []),
    ]
    inits = [
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("one", TensorProto.INT64, [], [1]),
    ]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return graphs.model(nodes, inputs, [y], inits)


def test_find_names_inputs_whose_values_reach_a_shape_operand():
    assert values.find(_reshape_model()) == {"shape": "by_input (Reshape) input 1"}
    assert set(values.find(_range_model())) == {"limit"}


def test_find_ignores_inputs_that_only_reach_shapes_through_shape_ops():
    """Token ids -> Gather -> Reshape(y, Shape(y)): the ids' values never decide a shape."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"]),
        helper.make_node("Shape", ["e"], ["s"]),
        helper.make_node("Reshape", ["e", "s"], ["y"]),
    ]
    table = helper.make_tensor("table", TensorProto.FLOAT, [4, 2], [0.0] * 8)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    assert values.find(graphs.model(nodes, [ids], [y], [table])) == {}


def test_find_follows_shape_of_a_value_sized_tensor():
    """Shape(Range(0, n)) depends on n's value: a Reshape by it makes n a value input."""
    nodes = [
        helper.make_node("Range", ["zero", "n", "one"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Reshape", ["x", "s"], ["y"]),
    ]
    inits = [
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("one", TensorProto.INT64, [], [1]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
        helper.make_tensor_value_info("n", TensorProto.INT64, []),
    ]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    assert set(values.find(graphs.model(nodes, inputs, [y], inits))) == {"n"}


def test_reshape_by_an_input_builds_and_compiles_one_program_per_set_of_values(tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_reshape_model()), path)
    out = tmp_path / "m.ekit"
    shapes = {"x": (2, 6), "shape": (2,)}
    ek.build(path, backend="xla", shapes=shapes, output=out, simplify=False).close()
    artifact = open_artifact(out)
    meta = artifact.manifest["backend"]["metadata"]
    assert meta["value_inputs"]["inputs"] == {"shape": "by_input (Reshape) input 1"}
    (stored,) = meta["value_inputs"]["programs"]
    assert values.from_json(stored["values"])["shape"].tolist() == [2, 6]
    assert "model.onnx" in artifact.manifest["payload"]

    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    with ek.load(out) as engine:
        assert engine.value_inputs == ("shape",)
        for target in ([3, 4], [4, 3], [2, 6], [3, 4], [-1, 2]):
            feeds = {"x": x, "shape": np.array(target, np.int64)}
            got = engine.infer(feeds)["y"]
            np.testing.assert_array_equal(got, reference(path, feeds)["y"])
        # [2, 6] is the build's program; [3, 4] came back from the cache.
        assert sorted(engine.programs) == [
            "shape=[-1, 2]: 2x6",
            "shape=[2, 6]: 2x6",
            "shape=[3, 4]: 2x6",
            "shape=[4, 3]: 2x6",
        ]
        with pytest.raises(EngineInputError, match=r"shape=\[5, 5\] does not compile"):
            engine.infer({"x": x, "shape": np.array([5, 5], np.int64)})


def test_range_with_an_input_limit_matches_onnxruntime(tmp_path):
    path = tmp_path / "r.onnx"
    ek.Model.save(ek.load_model(_range_model()), path)
    engine = ek.build(path, backend="xla", simplify=False)
    for limit in (3, 7, 1):
        feeds = {"x": np.array([0.5], np.float32), "limit": np.array(limit, np.int64)}
        np.testing.assert_array_equal(engine.infer(feeds)["y"], reference(path, feeds)["y"])
    assert engine.manifest["verify"]["passed"]
    engine.close()


def test_concurrent_first_calls_with_new_values_compile_once(tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_reshape_model()), path)
    engine = ek.build(
        path, backend="xla", shapes={"x": (2, 6), "shape": (2,)}, simplify=False, verify=False
    )
    feeds = {"x": np.ones((2, 6), np.float32), "shape": np.array([6, 2], np.int64)}

    def call() -> None:
        assert engine.infer(feeds)["y"].shape == (6, 2)

    assert not errors_in_threads(call)
    assert [k for k in engine.programs if k.startswith("shape=[6, 2]")] == ["shape=[6, 2]: 2x6"]
    engine.close()


def test_program_cache_drops_the_least_recently_used():
    cache: values.ProgramCache[str] = values.ProgramCache(size=2)
    made: list[str] = []

    def make(name: str):
        return lambda: made.append(name) or name

    keys = {n: values.key({"v": np.array([i])}) for i, n in enumerate("abc")}
    assert cache.get(keys["a"], make("a")) == "a"
    cache.get(keys["b"], make("b"))
    cache.get(keys["a"], make("a"))  # a is now the most recent
    cache.get(keys["c"], make("c"))  # evicts b
    cache.get(keys["a"], make("a"))
    cache.get(keys["b"], make("b"))
    assert made == ["a", "b", "c", "b"]
    assert len(cache) == 2


def test_key_tells_dtypes_and_shapes_apart():
    k = values.key
    assert k({"v": np.array([1, 2], np.int64)}) != k({"v": np.array([1, 2], np.int32)})
    assert k({"v": np.array([1, 2])}) != k({"v": np.array([[1, 2]])})
    assert k({"v": np.array([1, 2])}) == k({"v": np.array([1, 2])})


def test_a_large_value_input_is_refused_with_its_size():
    with pytest.raises(BuildError, match=r"'shape' feeds by_input \(Reshape\).*up to 2048"):
        values.check_sizes({"shape": "by_input (Reshape) input 1"}, {"shape": 2048})


def test_example_values_that_do_not_lower_leave_compiling_to_first_use(tmp_path, monkeypatch):
    """Generated example values the model rejects: the build keeps no program, verification on
    verify_data compiles the one it needs."""
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_reshape_model()), path)
    monkeypatch.setattr(values, "example_values", lambda *a, **k: {"shape": np.array([5, 5])})
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    data = {"x": x, "shape": np.array([4, 3], np.int64)}
    out = tmp_path / "m.ekit"
    ek.build(path, backend="xla", shapes={"x": (2, 6)}, simplify=False, verify_data=data,
             output=out).close()  # fmt: skip
    meta = open_artifact(out).manifest["backend"]["metadata"]
    assert meta["value_inputs"]["programs"] == []
    assert "model.stablehlo" not in open_artifact(out).manifest["payload"]
    with ek.load(out) as engine:
        assert engine.exported is None
        got = engine.infer({"x": x, "shape": np.array([3, 4], np.int64)})["y"]
        np.testing.assert_array_equal(got, x.reshape(3, 4))


def test_model_without_inputs_builds(tmp_path):
    """A model with no graph input (a constant output) has nothing to bucket by batch."""
    const = helper.make_tensor("c", TensorProto.FLOAT, [2], [1.0, 2.0])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["y"], value=const)],
        "constant_only",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "const.onnx"
    path.write_bytes(model.SerializeToString())
    with ek.build(str(path), backend="xla") as engine:
        np.testing.assert_array_equal(engine.infer({})["y"], [1.0, 2.0])


def test_compiling_new_values_does_not_hold_up_values_already_compiled(monkeypatch):
    """While one thread compiles a program for new values, another thread's call for the
    build's values runs at once (the compile used to hold the cache's lock)."""
    import threading

    engine = ek.build(
        _reshape_model(), backend="xla", shapes={"x": (2, 6), "shape": (2,)}, simplify=False
    )
    started, release = threading.Event(), threading.Event()
    specialize = engine._specializer

    def blocked(held, specs):
        started.set()
        assert release.wait(120)  # longer than the join below: a held lock fails the assert
        return specialize(held, specs)

    monkeypatch.setattr(engine, "_specializer", blocked)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    got: dict[str, tuple[int, ...]] = {}

    def infer(target: list[int]) -> None:
        got[str(target)] = engine.infer({"x": x, "shape": np.array(target)})["y"].shape

    new = threading.Thread(target=infer, args=([3, 4],))
    new.start()
    try:
        assert started.wait(60)
        built = threading.Thread(target=infer, args=([2, 6],))
        built.start()
        built.join(30)
        assert not built.is_alive() and got == {"[2, 6]": (2, 6)}
    finally:
        release.set()
    new.join(120)
    assert got == {"[2, 6]": (2, 6), "[3, 4]": (3, 4)}
    engine.close()


def test_verify_data_decides_the_program_compiled_at_build(tmp_path):
    """With verify_data, the build compiles the program verification runs (its values), not
    one for generated values and a second one for verification."""
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(_reshape_model()), path)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    data = {"x": x, "shape": np.array([4, 3], np.int64)}
    out = tmp_path / "m.ekit"
    with ek.build(path, backend="xla", shapes={"x": (2, 6)}, simplify=False, verify_data=data,
                  output=out) as engine:  # fmt: skip
        assert list(engine.programs) == ["shape=[4, 3]: 2x6"]
    (stored,) = open_artifact(out).manifest["backend"]["metadata"]["value_inputs"]["programs"]
    assert values.from_json(stored["values"])["shape"].tolist() == [4, 3]
