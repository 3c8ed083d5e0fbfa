"""TVM backend on the patterns of real transformers (BERT, GPT-2, ViT): symbolic reshapes,
positions from Range, GELU epilogues; each graph is the smallest that failed before the fix."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

TOKENS = {"ids": [(1, 1), (2, 6), (3, 9)]}


def _save(path: Path, nodes, inputs, outputs, inits) -> Path:
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()]
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _ids(batch: int, seq: int) -> dict[str, np.ndarray]:
    return {"ids": np.random.default_rng(batch * 10 + seq).integers(0, 10, (batch, seq))}


def _check(path: Path, feeds: list[dict[str, np.ndarray]], **options) -> ek.Engine:
    engine = ek.build(path, backend="tvm", shapes=TOKENS, **options)
    for feed in feeds:
        ref = reference(path, feed)
        got = engine.infer(feed)
        for name, value in ref.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
    return engine


def test_reshape_to_shape_ops_with_minus_one_builds_and_matches(tmp_path):
    # ids.reshape(-1, seq) from Shape ops (PyTorch's exporters, allowzero=1), a table lookup,
    # then the heads' merge x.reshape(-1, 4): the pattern named in the "data_ty->shape" failure
    # report. TVM 0.27 converts it once the shapes before it are kept (see the Range test).
    rng = np.random.default_rng(0)
    inits = {
        "minus_one": np.array([-1], np.int64),
        "flat": np.array([-1, 4], np.int64),
        "table": rng.standard_normal((10, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["ids"], ["seq"], start=1, end=2),
        helper.make_node("Concat", ["minus_one", "seq"], ["shape"], axis=0),
        helper.make_node("Reshape", ["ids", "shape"], ["same"], allowzero=1),
        helper.make_node("Gather", ["table", "same"], ["emb"]),
        helper.make_node("Reshape", ["emb", "flat"], ["y"]),
    ]
    path = _save(
        tmp_path / "reshape.onnx",
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        inits,
    )
    _check(path, [_ids(2, 6), _ids(3, 1)]).close()


def test_positions_from_range_over_the_sequence_length_keep_its_shape(tmp_path):
    # GPT-2's positions: Range(0, seq, 1) looked up and added to the token embeddings. TVM
    # 0.27 alone gives the range a fresh length, so the sum has no shape and the reshape
    # after it fails.
    rng = np.random.default_rng(1)
    inits = {
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "axis0": np.array([0], np.int64),
        "flat": np.array([-1, 4], np.int64),
        "tokens": rng.standard_normal((10, 4)).astype(np.float32),
        "positions": rng.standard_normal((16, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["ids"], ["seq1"], start=1, end=2),
        helper.make_node("Squeeze", ["seq1", "axis0"], ["seq"]),
        helper.make_node("Range", ["zero", "seq", "one"], ["arange"]),
        helper.make_node("Unsqueeze", ["arange", "axis0"], ["pos_ids"]),
        helper.make_node("Gather", ["positions", "pos_ids"], ["pos"]),
        helper.make_node("Gather", ["tokens", "ids"], ["tok"]),
        helper.make_node("Add", ["tok", "pos"], ["emb"]),
        helper.make_node("Reshape", ["emb", "flat"], ["y"]),
    ]
    path = _save(
        tmp_path / "range.onnx",
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        inits,
    )
    _check(path, [_ids(2, 6), _ids(1, 9)]).close()


def test_matmul_with_gelu_epilogue_compiles_and_matches(tmp_path):
    # x @ W + b, then GELU (x * 0.5 * (1 + erf(x / sqrt 2))): the epilogue reads the biased
    # sum twice. Folding it into the matmul's write-back used to drop that sum's producer
    # ("Buffer T_add_intermediate is used before its definition", flat_map_) on ViT and BERT.
    rng = np.random.default_rng(2)
    inits = {
        "w": rng.standard_normal((8, 16)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
        "sqrt2": np.array(math.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["hs"]),
        helper.make_node("Erf", ["hs"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    path = _save(
        tmp_path / "gelu.onnx",
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 16])],
        inits,
    )
    shapes = {"x": [(1, 5, 8), (2, 5, 8), (4, 5, 8)]}
    engine = ek.build(path, backend="tvm", shapes=shapes)
    x = {"x": rng.standard_normal((3, 5, 8)).astype(np.float32)}
    np.testing.assert_allclose(engine.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-5)
    engine.close()


def test_class_token_expanded_to_a_batch_read_by_a_gather_keeps_its_shape(tmp_path):
    # make_batch_dynamic reads the batch as Gather(Shape(x), [0]) (a one-element index
    # vector) and expands ViT's class token to it; TVM 0.27 turned that shape into a runtime
    # tensor, the concatenated tokens lost their dims and the Reshape after them failed.
    rng = np.random.default_rng(1)
    inits = {
        "zero": np.array([0], np.int64),
        "rest": np.array([1, 4], np.int64),
        "token": rng.standard_normal((1, 1, 4)).astype(np.float32),
        "flat": np.array([-1, 2, 2], np.int64),
    }
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0),
        helper.make_node("Expand", ["token", "target"], ["tokens"]),
        helper.make_node("Concat", ["tokens", "x"], ["seq"], axis=1),
        helper.make_node("Reshape", ["seq", "flat"], ["y"]),
    ]
    path = _save(
        tmp_path / "class_token.onnx",
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2, 2])],
        inits,
    )
    engine = ek.build(path, backend="tvm", shapes={"x": [(1, 3, 4), (2, 3, 4), (4, 3, 4)]})
    for batch in (1, 3):
        feed = {"x": rng.standard_normal((batch, 3, 4)).astype(np.float32)}
        np.testing.assert_allclose(
            engine.infer(feed)["y"], reference(path, feed)["y"], rtol=1e-5, atol=1e-6
        )
    engine.close()
