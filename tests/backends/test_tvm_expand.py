"""TVM backend coverage fixes on enginekit's side: ONNX function ops expanded to their bodies
before import, Constant's value_* attributes, and enginekit's own converters (Cosh, Sinh)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference
from onnx import TensorProto, helper

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")


def _one_node(tmp_path, node, opset, inputs, output=None):
    """A model of ``node`` alone; ``inputs`` maps name -> static shape (``output``: the
    output's shape, default the first input's)."""
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [
            helper.make_tensor_value_info(
                o, TensorProto.FLOAT, output or next(iter(inputs.values()))
            )
            for o in node.output
        ],
    )
    path = tmp_path / f"{node.op_type}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _check(path, inputs, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    shapes = {n: [s, s, s] for n, s in inputs.items()}
    with ek.build(path, backend="tvm", shapes=shapes) as engine:
        got = engine.infer(feeds)
    want = reference(path, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)


def test_celu_is_expanded_to_its_function_body(tmp_path):
    # Celu has no TVM converter ("cannot convert op 'Celu'"); its ONNX function body
    # (Div, Elu, Mul) converts.
    inputs = {"x": (2, 4, 8)}
    node = helper.make_node("Celu", ["x"], ["y"], alpha=0.7)
    _check(_one_node(tmp_path, node, 17, inputs), inputs)


def test_standard_attention_is_expanded_not_given_to_the_contrib_converter(tmp_path):
    # TVM's "Attention" converter is com.microsoft's (it wanted a num_heads attribute); the
    # standard op's context-dependent body is imported instead (its Shape arithmetic folded).
    inputs = {"q": (1, 2, 3, 8), "k": (1, 2, 5, 8), "v": (1, 2, 5, 8)}
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    _check(_one_node(tmp_path, node, 23, inputs, output=(1, 2, 3, 8)), inputs)


def test_swish_is_expanded_to_its_function_body(tmp_path):
    inputs = {"x": (2, 6)}
    node = helper.make_node("Swish", ["x"], ["y"], alpha=1.5)
    _check(_one_node(tmp_path, node, 24, inputs), inputs)


def test_constant_given_by_value_float_and_value_ints_imports(tmp_path):
    # Function bodies (Swish's alpha) and some exporters write Constant<value_float=...>;
    # TVM read only ``value`` ("no value in Constant"). Unsimplified, so the Constant nodes
    # reach the importer as written.
    nodes = [
        helper.make_node("Constant", [], ["a"], value_float=1.5),
        helper.make_node("Constant", [], ["shape"], value_ints=[3, 2]),
        helper.make_node("Mul", ["x", "a"], ["m"]),
        helper.make_node("Reshape", ["m", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 3))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (3, 2))],
    )
    path = tmp_path / "constants.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    x = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with ek.build(path, backend="tvm", shapes={"x": [(2, 3)] * 3}, simplify=False) as engine:
        np.testing.assert_allclose(engine.infer(x)["y"], reference(path, x)["y"])


@pytest.mark.parametrize("op", ["Cosh", "Sinh"])
def test_cosh_and_sinh_compile(tmp_path, op):
    # TVM 0.27 imported them as tirx.cosh/sinh, which LLVM codegen rejects ("unknown
    # intrinsic") after the whole build; enginekit's converters use exp.
    inputs = {"x": (3, 5)}
    _check(_one_node(tmp_path, helper.make_node(op, ["x"], ["y"]), 18, inputs), inputs)


def test_layer_normalization_over_several_axes_with_mean_and_inv_std_dev(tmp_path):
    # TVM 0.27's converter returned the constant 0 for Mean and InvStdDev (ONNX's
    # layer_normalization_*_axis0 cases failed verification).
    node = helper.make_node(
        "LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv"], axis=1
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 3, 4)),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, (3, 4)),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, (3, 4)),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, 4)),
            helper.make_tensor_value_info("mean", TensorProto.FLOAT, (2, 1, 1)),
            helper.make_tensor_value_info("inv", TensorProto.FLOAT, (2, 1, 1)),
        ],
    )
    path = tmp_path / "layernorm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _check(path, {"x": (2, 3, 4), "scale": (3, 4), "bias": (3, 4)})


def test_constant_value_floats_inside_an_if_branch_imports(tmp_path):
    # Expanded function bodies (AffineGrid's) hold Constant<value_ints=...> in If branches;
    # only the top-level graph's were rewritten ("no value in Constant").
    def branch(name, values):
        const = helper.make_node("Constant", [], [name], value_floats=values)
        out = helper.make_tensor_value_info(name, TensorProto.FLOAT, (2,))
        return helper.make_graph([const], name, [], [out])

    nodes = [
        helper.make_node(
            "If",
            ["c"],
            ["v"],
            then_branch=branch("a", [1.0, 2.0]),
            else_branch=branch("b", [3.0, 4.0]),
        ),
        helper.make_node("Add", ["x", "v"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, ()),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, (2,)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2,))],
    )
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    shapes = {"c": [()] * 3, "x": [(2,)] * 3}
    x = np.zeros(2, np.float32)
    with ek.build(path, backend="tvm", shapes=shapes, simplify=False) as engine:
        for c, want in ((True, [1, 2]), (False, [3, 4])):
            np.testing.assert_array_equal(engine.infer({"c": np.array(c), "x": x})["y"], want)


def test_qlinear_matmul_with_float16_scales_is_rewritten(tmp_path):
    # TVM 0.27 has no QLinearMatMul converter; it becomes Dequantize/MatMul/Quantize with the
    # scales in float32 (in float16 the outputs were a level off).
    u8 = TensorProto.UINT8
    init = [
        onnx.numpy_helper.from_array(np.array(v, dt), n)
        for n, v, dt in [
            ("a_s", 0.0066, np.float16),
            ("a_z", 113, np.uint8),
            ("b_s", 0.00705, np.float16),
            ("b_z", 114, np.uint8),
            ("y_s", 0.0107, np.float16),
            ("y_z", 118, np.uint8),
        ]
    ]
    node = helper.make_node(
        "QLinearMatMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"]
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("a", u8, (2, 4)),
            helper.make_tensor_value_info("b", u8, (4, 3)),
        ],
        [helper.make_tensor_value_info("y", u8, (2, 3))],
        init,
    )
    path = tmp_path / "qlmm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    rng = np.random.default_rng(0)
    feeds = {
        "a": rng.integers(0, 256, (2, 4), np.uint8),
        "b": rng.integers(0, 256, (4, 3), np.uint8),
    }
    with ek.build(path, backend="tvm", shapes={"a": [(2, 4)] * 3, "b": [(4, 3)] * 3}) as engine:
        np.testing.assert_array_equal(engine.infer(feeds)["y"], reference(path, feeds)["y"])


def test_an_attribute_the_node_omits_takes_the_ops_default_in_its_body():
    # HammingWindow's body reads @periodic into a Constant and casts to @output_datatype;
    # without the schema's defaults they were an empty Constant and a Cast with no 'to'.
    from enginekit.backends.tvm.expand import function_body, inline

    node = helper.make_node("HammingWindow", ["n"], ["w"])
    body = function_body(node, 17, {})
    nodes = {n.output[0]: n for n in inline(node, body, "h_", 17)}
    periodic = nodes["h_IsPeriodic"].attribute
    assert [(a.name, a.i) for a in periodic] == [("value_int", 1)]
    assert [(a.name, a.i) for a in nodes["w"].attribute] == [("to", TensorProto.FLOAT)]
