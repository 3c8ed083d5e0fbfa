"""Verification inputs: integer inputs that reach shape or index positions get valid values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import enginekit as ek
from enginekit.feeds import find_uses, make_feeds
from enginekit.model import load_model, reference_session

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def model(nodes, inputs, outputs, inits=(), name="m"):
    graph = h.make_graph(nodes, name, inputs, outputs, list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def test_token_ids_of_an_embedding_stay_below_the_vocabulary():
    table = nh.from_array(np.ones((300, 4), np.float32), "emb")
    m = model(
        [h.make_node("Gather", ["emb", "ids"], ["y"])],
        [vi("ids", I64, ["batch", 7])],
        [vi("y", F, ["batch", 7, 4])],
        [table],
    )
    feeds = make_feeds(load_model(m), {"ids": (4, 7)})
    assert feeds["ids"].max() < 300 and feeds["ids"].max() > 1  # spread, not only 0/1
    assert feeds["ids"].min() == 0 and feeds["ids"].max() == 299  # both ends of the vocabulary
    ek.build(m, shapes={"ids": [(1, 7), (2, 7), (4, 7)]}).close()


def test_expand_reshape_tile_range_topk_slice_get_valid_values():
    m = model(
        [
            h.make_node("Expand", ["x", "eshape"], ["e"]),
            h.make_node("Reshape", ["x", "rshape"], ["r"]),
            h.make_node("Tile", ["x", "reps"], ["t"]),
            h.make_node("Range", ["start", "limit", "delta"], ["rg"]),
            h.make_node("TopK", ["x", "k"], ["tv", "ti"], axis=-1),
            h.make_node("Slice", ["x", "starts", "ends"], ["s"]),
            h.make_node("ConstantOfShape", ["cshape"], ["c"]),
        ],
        [
            vi("x", F, [2, 3, 4]),
            vi("eshape", I64, [3]),
            vi("rshape", I64, [2]),
            vi("reps", I64, [3]),
            vi("start", I64, []),
            vi("limit", I64, []),
            vi("delta", I64, []),
            vi("k", I64, [1]),
            vi("starts", I64, [1]),
            vi("ends", I64, [1]),
            vi("cshape", I64, [2]),
        ],
        [vi(n, I64 if n == "rg" else F, None) for n in ("e", "r", "t", "rg", "tv", "s", "c")],
    )
    shapes = {
        i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in m.graph.input
    }
    feeds = make_feeds(load_model(m), shapes)
    assert feeds["eshape"].tolist() == [1, 1, 1] and feeds["reps"].tolist() == [1, 1, 1]
    assert feeds["rshape"].tolist() == [2, -1] and feeds["k"].tolist() == [1]
    assert feeds["delta"] == 1 and feeds["limit"] > feeds["start"]
    engine = ek.build(m)
    assert engine.manifest["verify"]["passed"]


def test_shape_arithmetic_chain_into_reshape_is_found_and_tried():
    # n -> Unsqueeze -> Concat([n, -1]) -> Reshape(x): the batch size must come out of n.
    m = model(
        [
            h.make_node("Unsqueeze", ["n", "zero"], ["n1"]),
            h.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
            h.make_node("Reshape", ["x", "shape"], ["y"]),
        ],
        [vi("x", F, [6, 4]), vi("n", I64, [])],
        [vi("y", F, None)],
        [
            nh.from_array(np.array([0], np.int64), "zero"),
            nh.from_array(np.array([-1], np.int64), "minus1"),
        ],
    )
    uses = find_uses(m, ["n"])
    assert [(u.op, u.slot, u.exact) for u in uses["n"]] == [("Reshape", 1, False)]
    loaded = load_model(m)
    feeds = make_feeds(loaded, {"x": (6, 4), "n": ()}, session=reference_session(loaded))
    assert 24 % int(feeds["n"]) == 0
    ek.build(m).close()


def test_gathernd_and_gather_on_a_graph_input_use_the_indexed_dims():
    m = model(
        [
            h.make_node("GatherND", ["x", "nd"], ["a"]),
            h.make_node("Gather", ["x", "idx"], ["b"], axis=1),
        ],
        [vi("x", F, [5, 9]), vi("nd", I64, [3, 2]), vi("idx", I64, [4])],
        [vi("a", F, None), vi("b", F, None)],
    )
    feeds = make_feeds(load_model(m), {"x": (5, 9), "nd": (3, 2), "idx": (4,)}, seed=1)
    assert feeds["nd"][:, 0].max() < 5 and feeds["nd"][:, 1].max() < 9
    assert feeds["idx"].max() < 9
    ek.build(m).close()


def test_no_valid_value_stops_the_build_asking_for_verify_data():
    # Reshape to [n, n]: only n*n == 10 would do, and no integer n has that.
    m = model(
        [
            h.make_node("Concat", ["n", "n"], ["shape"], axis=0),
            h.make_node("Reshape", ["x", "shape"], ["y"]),
        ],
        [vi("x", F, [10]), vi("n", I64, [1])],
        [vi("y", F, None)],
        name="square",
    )
    with pytest.raises(ek.BuildError, match=r"input 'n' reaches Reshape.*verify_data="):
        ek.build(m)
    x = np.arange(10, dtype=np.float32)
    with pytest.raises(ek.BuildError, match="on the verify_data"):  # wrong data is named too
        ek.build(m, verify_data={"x": x, "n": np.array([3], np.int64)})


def test_masks_and_plain_integer_inputs_keep_random_zero_one_values():
    m = model(
        [h.make_node("Cast", ["mask"], ["y"], to=F)],
        [vi("mask", I64, ["batch", 5])],
        [vi("y", F, ["batch", 5])],
    )
    feeds = make_feeds(load_model(m), {"mask": (3, 5)})
    assert set(np.unique(feeds["mask"])) <= {0, 1}
