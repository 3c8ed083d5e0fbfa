"""Shape arithmetic on symbolic dims (batch, seq) lowers, builds once, and runs at every size;
If lowers its branch when the condition is known at build time.

Each graph is the smallest form of a pattern a real exported model has: ConvNeXt's residual
adds a channels-last conv output to an ONNX-layout tensor (``2048*batch`` elements), BERT and
GPT-2 slice a fixed position table to ``seq`` and build ``Range(0, seq)``, attention heads
merge with ``Reshape(x, [batch, seq, -1])`` computed from Shape ops.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

from onnx import TensorProto, helper, numpy_helper
from xla_graphs import model

import enginekit as ek
from enginekit.backends.xla import program
from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec


def _int(name: str, *values: int):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _check(m, shapes, feeds_at, sizes, tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(m), path)
    engine = ek.build(path, backend="xla", shapes=shapes, xla_flags="xla-default")
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for size in sizes:
        feeds = feeds_at(size)
        want = session.run(None, feeds)
        got = engine.infer(feeds)
        for w, g in zip(want, got.values()):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    return engine


def test_channels_last_conv_plus_onnx_layout_tensor_over_symbolic_batch(tmp_path):
    """ConvNeXt: Add(Conv(x), x * s) held in two layouts; their sizes are products of batch."""
    w = np.random.default_rng(0).standard_normal((4, 4, 1, 1)).astype(np.float32)
    m = model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"]),
            helper.make_node("Mul", ["x", "s"], ["m"]),
            helper.make_node("Add", ["c", "m"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0.5), "s")],
    )
    rng = np.random.default_rng(1)
    _check(
        m,
        {"x": [(1, 4, 8, 8), (2, 4, 8, 8), (8, 4, 8, 8)]},
        lambda b: {"x": rng.standard_normal((b, 4, 8, 8)).astype(np.float32)},
        (1, 3, 8),
        tmp_path,
    )


def _positions_graph():
    """ids [batch, seq] -> ids + table[:, :seq] + Range(0, seq): GPT-2's position ids."""
    table = np.arange(64, dtype=np.int64).reshape(1, 64) * 10
    return model(
        [
            helper.make_node("Shape", ["ids"], ["shape"]),
            helper.make_node("Gather", ["shape", "one_s"], ["seq"], axis=0),
            helper.make_node("Unsqueeze", ["seq", "zero"], ["end"]),
            helper.make_node("Slice", ["table", "zero", "end", "one"], ["pos"]),
            helper.make_node("Range", ["zero_s", "seq", "one_s"], ["steps"]),
            helper.make_node("Add", ["ids", "pos"], ["a"]),
            helper.make_node("Add", ["a", "steps"], ["y"]),
        ],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", "seq"])],
        [
            numpy_helper.from_array(table, "table"),
            _int("zero", 0),
            _int("one", 1),
            numpy_helper.from_array(np.int64(0), "zero_s"),
            numpy_helper.from_array(np.int64(1), "one_s"),
        ],
    )


def test_slice_of_a_static_table_to_a_symbolic_length_and_range_to_it(tmp_path):
    """Needs the profile's ``seq <= 64`` as a jax.export constraint: else inconclusive."""
    engine = _check(
        _positions_graph(),
        {"ids": [(1, 1), (2, 8), (4, 64)]},
        lambda s: {"ids": np.arange(2 * s, dtype=np.int64).reshape(2, s)},
        (1, 5, 64),
        tmp_path,
    )
    meta = engine.manifest["backend"]["metadata"]
    assert "seq <= 64" in meta["symbolic_constraints"]


def test_heads_split_and_merged_by_reshapes_built_from_shape_ops(tmp_path):
    """[b, s, 8] -> [b, s, 2, -1] -> transpose -> [b, s, -1] from Shape, products of dims."""
    m = model(
        [
            helper.make_node("Reshape", ["x", "split"], ["h"]),
            helper.make_node("Transpose", ["h"], ["t"], perm=[0, 2, 1, 3]),
            helper.make_node("Transpose", ["t"], ["u"], perm=[0, 2, 1, 3]),
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "zero", "two"], ["bs"]),
            helper.make_node("Concat", ["bs", "minus_one"], ["merged"], axis=0),
            helper.make_node("Reshape", ["u", "merged"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        [_int("split", 0, 0, 2, -1), _int("zero", 0), _int("two", 2), _int("minus_one", -1)],
    )
    rng = np.random.default_rng(2)
    _check(
        m,
        {"x": [(1, 1, 8), (2, 4, 8), (4, 16, 8)]},
        lambda s: {"x": rng.standard_normal((3, s, 8)).astype(np.float32)},
        (1, 7, 16),
        tmp_path,
    )


def test_symbol_bounds_span_every_profile_and_input():
    specs = [TensorSpec("a", "float32", ("batch", "seq")), TensorSpec("b", "int64", ("batch",))]
    profiles = [
        {"a": ShapeProfile((1, 4), (2, 8), (8, 32)), "b": ShapeProfile((1,), (2,), (8,))},
        {"a": ShapeProfile((2, 4), (16, 8), (16, 128)), "b": ShapeProfile((2,), (16,), (16,))},
    ]
    dims = program.symbolic_dims(specs, profiles)
    bounds = program.symbol_bounds(specs, profiles, dims)
    assert bounds == {"batch": [1, 16], "seq": [4, 128]}
    assert program.constraints(bounds) == ("batch <= 16", "seq >= 4", "seq <= 128")


def _if_graph(cond_nodes, cond_inputs=()):
    """y = If(cond, then: x * 2, else: x + 1), x [batch, 4]."""
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Add", ["x", "two"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    nodes = [
        *cond_nodes,
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]), *cond_inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.float32(2.0), "two"), _int("rank2", 2)],
    )


def test_if_on_a_condition_computed_from_shapes_lowers_the_branch_taken(tmp_path):
    m = _if_graph(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Size", ["shape"], ["rank"]),
            helper.make_node("Equal", ["rank", "rank2"], ["eq"]),
            helper.make_node("Squeeze", ["eq"], ["cond"]),
        ]
    )
    rng = np.random.default_rng(3)
    _check(
        m,
        {"x": [(1, 4), (2, 4), (8, 4)]},
        lambda b: {"x": rng.standard_normal((b, 4)).astype(np.float32)},
        (1, 5),
        tmp_path,
    )


def test_if_on_a_condition_from_input_values_compiles_the_branch_each_value_takes(tmp_path):
    """The condition is a value input (values.py): one program per condition value."""
    m = _if_graph([], [helper.make_tensor_value_info("cond", TensorProto.BOOL, [1])])
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(m), path)
    engine = ek.build(
        path, backend="xla", shapes={"x": (2, 4), "cond": (1,)}, xla_flags="xla-default"
    )
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for cond in (True, False):
        got = engine.infer({"x": x, "cond": np.array([cond])})["y"]
        np.testing.assert_array_equal(got, x * 2 if cond else x + 2)
    assert engine.value_inputs == ("cond",)


def _resize_to_sizes_graph(mode: str):
    """F.interpolate(x, size=(12, 10)) as torch exports it: Resize's sizes are
    Concat(Shape(x)[:2], [12, 10]), so they hold the symbolic batch next to constant H, W."""
    return model(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "zero", "two", "zero"], ["nc"]),
            helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
            helper.make_node(
                "Resize",
                ["x", "", "", "sizes"],
                ["y"],
                mode=mode,
                coordinate_transformation_mode="pytorch_half_pixel",
            ),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 12, 10])],
        [_int("zero", 0), _int("two", 2), _int("hw", 12, 10)],
    )


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resize_to_sizes_holding_the_symbolic_batch_resizes_only_spatial_axes(mode, tmp_path):
    """Segmentation heads (LR-ASPP, DeepLabV3, FCN) upsample to the input's H, W this way."""
    rng = np.random.default_rng(4)
    _check(
        _resize_to_sizes_graph(mode),
        {"x": [(1, 3, 6, 5), (2, 3, 6, 5), (4, 3, 6, 5)]},
        lambda b: {"x": rng.standard_normal((b, 3, 6, 5)).astype(np.float32)},
        (1, 3, 4),
        tmp_path,
    )
