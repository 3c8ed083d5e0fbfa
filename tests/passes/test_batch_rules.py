"""make_batch_dynamic on the patterns of classic fixed-batch model-zoo files: each minimal model
here bakes batch 1 in the way a zoo file does, and is checked at batches 1, 3 and 8 against the
original run one row at a time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit import passes

RNG = np.random.default_rng(0)


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)


def _model(nodes, inits, x_shape, y_shape, opset: int = 11, ms: bool = False) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "zoo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    imports = [helper.make_opsetid("", opset)]
    if ms:
        imports.append(helper.make_opsetid("com.microsoft", 1))
    return helper.make_model(graph, opset_imports=imports)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _assert_batch_dynamic(original: onnx.ModelProto, dynamic: onnx.ModelProto) -> None:
    assert ek.lint_batch(dynamic, sizes=(1, 3, 8)) == []
    dims = original.graph.input[0].type.tensor_type.shape.dim
    x = RNG.standard_normal((3, *[d.dim_value for d in dims][1:])).astype(np.float32)
    rows = np.concatenate([_run(original, x[i : i + 1]) for i in range(3)])
    np.testing.assert_allclose(_run(dynamic, x), rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_run(dynamic, x[:1]), _run(original, x[:1]))


def _pooled_head(ms: bool) -> onnx.ModelProto:
    """Conv -> (com.microsoft Gelu: ONNX's shape inference knows no shape past it) -> global
    pool -> Reshape to the constant [1, 8] -> Gemm: the zoo's head after global pooling."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Gelu", ["c"], ["g"], domain="com.microsoft")
        if ms
        else helper.make_node("Relu", ["c"], ["g"]),
        helper.make_node("GlobalAveragePool", ["g"], ["p"]),
        helper.make_node("Reshape", ["p", "shape"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["y"]),
    ]
    inits = [
        _init("w", RNG.standard_normal((8, 3, 3, 3)).astype(np.float32)),
        _init("shape", np.array([1, 8], np.int64)),
        _init("fc", RNG.standard_normal((8, 5)).astype(np.float32)),
    ]
    return _model(nodes, inits, [1, 3, 6, 6], [1, 5], ms=ms)


def test_reshape_after_global_pool_is_proven_past_an_op_onnx_cannot_infer():
    model = _pooled_head(ms=True)
    only_onnx = passes.rewrite_batch(model, provers=("onnx",))
    (line,) = only_onnx.unproven
    assert "Reshape" in line and "[1, 8]" in line and "unknown" in line
    with pytest.raises(ek.ModelError, match="at batch 3"):
        ek.lint_batch(only_onnx.model, sizes=(1, 3))
    result = passes.rewrite_batch(model)
    assert result.unproven == ()
    assert any("[1, 8] -> [0, 8]" in line and "ort-symbolic" in line for line in result.rewritten)
    _assert_batch_dynamic(model, result.model)
    # Dim 0 followed op by op proves it too, without any shape inference.
    axis_only = passes.rewrite_batch(model, provers=("batch-axis",))
    assert axis_only.unproven == () and "batch-axis" in axis_only.rewritten[-1]


def test_channel_shuffle_5d_reshape_becomes_batch_dynamic():
    c, g, h = 8, 2, 4
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Gelu", ["c"], ["a"], domain="com.microsoft"),
        helper.make_node("Reshape", ["a", "s5"], ["r5"]),
        helper.make_node("Transpose", ["r5"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "s4"], ["y"]),
    ]
    inits = [
        _init("w", RNG.standard_normal((c, 3, 3, 3)).astype(np.float32)),
        _init("s5", np.array([1, g, c // g, h, h], np.int64)),
        _init("s4", np.array([1, c, h, h], np.int64)),
    ]
    model = _model(nodes, inits, [1, 3, h, h], [1, c, h, h], ms=True)
    with pytest.raises(ek.ModelError, match="at batch 3"):
        ek.lint_batch(passes.rewrite_batch(model, provers=("onnx",)).model, sizes=(1, 3))
    result = passes.rewrite_batch(model)
    assert result.unproven == ()
    assert sum("Reshape" in line for line in result.rewritten) == 2
    _assert_batch_dynamic(model, result.model)


def test_concat_built_reshape_shape_is_rewritten_in_its_first_piece():
    # shape = Concat([1], Shape(p)[1:2]): the batch baked into the first piece only.
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["p"]),
        helper.make_node("Shape", ["p"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["c"], axis=0),
        helper.make_node("Concat", ["lead", "c"], ["shape"], axis=0),
        helper.make_node("Reshape", ["p", "shape"], ["y"]),
    ]
    inits = [_init("lead", np.array([1], np.int64)), _init("one", np.array([1], np.int64))]
    model = _model(nodes, inits, [1, 3, 4, 4], [1, 3])
    result = passes.rewrite_batch(model)
    assert any("first piece of Concat" in line for line in result.rewritten)
    _assert_batch_dynamic(model, result.model)


def _class_token(maker: str) -> onnx.ModelProto:
    """A ViT's class token made batch-sized by Expand/Tile at batch 1, or the bare token."""
    d = 4
    nodes = [
        helper.make_node("Reshape", ["x", "patches"], ["seq"]),  # [1, 3, 16] -> [1, 12, 4]
    ]
    inits = [
        _init("patches", np.array([1, -1, d], np.int64)),
        _init("cls", RNG.standard_normal((1, 1, d)).astype(np.float32)),
    ]
    if maker == "Expand":
        nodes.append(helper.make_node("Expand", ["cls", "cls_shape"], ["tok"]))
        inits.append(_init("cls_shape", np.array([1, 1, d], np.int64)))
    elif maker == "Tile":
        nodes.append(helper.make_node("Tile", ["cls", "reps"], ["tok"]))
        inits.append(_init("reps", np.array([1, 1, 1], np.int64)))
    token = "cls" if maker == "bare" else "tok"
    nodes.append(helper.make_node("Concat", [token, "seq"], ["y"], axis=1))
    return _model(nodes, inits, [1, 3, 16], [1, 13, d])


@pytest.mark.parametrize("maker", ["Expand", "Tile", "bare"])
def test_class_token_joined_to_the_batch_follows_it(maker):
    model = _class_token(maker)
    result = passes.rewrite_batch(model)
    assert result.unproven == ()
    if maker == "bare":
        assert any("expanded to the batch" in line for line in result.rewritten)
    else:
        assert any(f"{maker} " in line and "batch of" in line for line in result.rewritten)
    _assert_batch_dynamic(model, result.model)


def test_expand_baked_at_batch_4_reads_the_batch_from_its_concat_peer():
    d = 4
    nodes = [
        helper.make_node("Reshape", ["x", "patches"], ["seq"]),
        helper.make_node("Expand", ["cls", "cls_shape"], ["tok"]),
        helper.make_node("Concat", ["tok", "seq"], ["y"], axis=1),
    ]
    inits = [
        _init("patches", np.array([4, -1, d], np.int64)),
        _init("cls", RNG.standard_normal((1, 1, d)).astype(np.float32)),
        _init("cls_shape", np.array([4, 1, d], np.int64)),
    ]
    model = _model(nodes, inits, [4, 3, 16], [4, 13, d])
    result = passes.rewrite_batch(model)
    assert result.batch == 4 and result.unproven == ()
    assert ek.lint_batch(result.model, sizes=(1, 3, 8)) == []


def test_unprovable_constant_is_named_with_what_to_do():
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["ones"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        helper.make_node("Add", ["x", "ones"], ["y"]),
    ]
    model = _model(nodes, [_init("shape", np.array([2, 4], np.int64))], [2, 4], [2, 4])
    with pytest.raises(ek.ModelError) as err:
        ek.make_batch_dynamic(model, strict=True)
    text = str(err.value)
    assert "ConstantOfShape 'ones'" in text and "[2, 4]" in text
    assert "lint_batch" in text and "re-export" in text


def test_batch_folded_into_attention_heads_follows_by_layout():
    """nn.MultiheadAttention's layout at batch 1: [1, 17, 8] -> [17, 1, 8] -> heads folded with
    the batch ([17, 1*2, 4]) -> [2, 17, 4] -> [1, 2, 17, 4]: constants that hold the batch in
    axis 1, then inside a product."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "heads"], ["h"]),
        helper.make_node("Transpose", ["h"], ["th"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["th", "split"], ["y"]),
    ]
    inits = [
        _init("heads", np.array([17, 2, 4], np.int64)),
        _init("split", np.array([1, 2, 17, 4], np.int64)),
    ]
    model = _model(nodes, inits, [1, 17, 8], [1, 2, 17, 4])
    without = passes.rewrite_batch(model, provers=("onnx", "ort-symbolic", "batch-axis"))
    with pytest.raises(ek.ModelError, match="at batch 3"):
        ek.lint_batch(without.model, sizes=(1, 3))
    result = passes.rewrite_batch(model)
    assert result.unproven == ()
    assert [line.split(" (proof")[0] for line in result.rewritten] == [
        "Reshape 'h': shape [17, 2, 4] -> [17, -1, 4]",
        "Reshape 'y': shape [1, 2, 17, 4] -> [-1, 2, 17, 4]",
    ]
    _assert_batch_dynamic(model, result.model)
