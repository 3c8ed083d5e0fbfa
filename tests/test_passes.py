"""Graph preparation: simplification inside build, opset conversion, subgraphs, renaming, and
making the batch of legacy models dynamic."""

from __future__ import annotations

import json
import sys
import types
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit import backends, passes
from enginekit.backends import onnxruntime as ort_backend


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def _const(name: str, values: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(values))


def foldable_model() -> onnx.ModelProto:
    """y = relu(x @ W + (a * b + a)) with a, b constants, plus a dead branch and a no-op chain."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(8).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    w = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W")
    nodes = [
        _const("a", a),
        _const("b", b),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Add", ["ab", "a"], ["bias"]),
        helper.make_node("Identity", ["bias"], ["bias2"]),
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "bias2"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["y"]),
        helper.make_node("Neg", ["a"], ["unused"]),  # dead: feeds nothing
        helper.make_node("Exp", ["unused"], ["unused2"]),
    ]
    graph = helper.make_graph(
        nodes,
        "foldable",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def legacy_model() -> onnx.ModelProto:
    """What an old exporter wrote: opset 9, IR 4, every initializer also a graph input, batch 1
    baked into a Reshape initializer and a Constant node, and a Flatten(axis=0)."""
    rng = np.random.default_rng(1)
    inits = {
        "conv_w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "conv_b": rng.standard_normal(4).astype(np.float32),
        "shape1": np.array([1, 4, 36], np.int64),
        "fc_w": rng.standard_normal((6, 144)).astype(np.float32),
        "fc_b": rng.standard_normal(6).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "shape1"], ["r3"]),  # [1, 4, 36]
        helper.make_node("Softmax", ["r3"], ["s"], axis=2),
        helper.make_node(
            "Constant", [], ["shape2"], value=numpy_helper.from_array(np.array([1, 144], np.int64))
        ),
        helper.make_node("Reshape", ["s", "shape2"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
        helper.make_node("Flatten", ["r"], ["all"], axis=0),  # [1, 144]
        helper.make_node("ReduceSum", ["all"], ["total"], axes=[1], keepdims=1),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    inputs += [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in inits.items()
    ]
    graph = helper.make_graph(
        nodes,
        "legacy",
        inputs,
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 6]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [1, 1]),
        ],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 4
    return model


def test_simplify_shrinks_foldable_model_and_keeps_its_outputs():
    model = foldable_model()
    out = passes.simplify(model)
    assert passes.count_nodes(out) < passes.count_nodes(model)
    ops = [n.op_type for n in out.graph.node]
    assert "Mul" not in ops and "Neg" not in ops and "Exp" not in ops and "Identity" not in ops
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(out, {"x": x})[0], _run(model, {"x": x})[0], rtol=1e-6)
    assert [i.name for i in out.graph.input] == ["x"]
    assert [o.name for o in out.graph.output] == ["y"]


def test_build_records_simplify_and_keeps_source_hash(tmp_path):
    model = foldable_model()
    path = tmp_path / "foldable.onnx"
    onnx.save(model, path)
    engine = ek.build(path, shapes={"x": [(1, 4), (4, 4), (8, 4)]}, output=tmp_path / "f.ekit")
    manifest = ek.load(tmp_path / "f.ekit").manifest
    (record,) = manifest["passes"]
    assert record["name"] == "simplify"
    assert record["nodes_after"] < record["nodes_before"] == len(model.graph.node)
    assert record["seconds"] >= 0 and record["tool"].startswith("onnxslim")
    assert manifest["source"]["sha256"] == ek.load_model(path).sha256
    assert manifest["verify"]["passed"] and manifest["config"]["simplify"] is True
    x = np.random.default_rng(3).standard_normal((7, 4)).astype(np.float32)
    np.testing.assert_allclose(engine.infer(x)["y"], _run(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_build_without_simplify_runs_no_pass(tmp_path):
    engine = ek.build(foldable_model(), shapes={"x": (2, 4)}, simplify=False)
    assert engine.manifest["passes"] == []
    assert engine.manifest["config"]["simplify"] is False


def test_legacy_opset9_model_becomes_dynamic_batch_and_runs_at_batch_5():
    model = legacy_model()
    result = passes.rewrite_batch(model)
    assert result.batch == 1 and result.unproven == ()
    assert any("initializer" in line for line in result.rewritten)
    assert any("Flatten" in line for line in result.rewritten)
    dynamic = result.model
    assert [i.name for i in dynamic.graph.input] == ["x"]
    assert ek.lint_batch(dynamic) == []
    engine = ek.build(dynamic, shapes={"x": [(1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8)]})
    x = np.random.default_rng(4).standard_normal((5, 3, 8, 8)).astype(np.float32)
    got = engine.infer(x)
    rows = [_run(model, {"x": x[i : i + 1]}) for i in range(5)]
    np.testing.assert_allclose(got["logits"], np.concatenate([r[0] for r in rows]), rtol=1e-4)
    np.testing.assert_allclose(got["total"], np.concatenate([r[1] for r in rows]), rtol=1e-4)


def test_rewrite_batch_reports_what_it_cannot_prove():
    # ConstantOfShape([2, 4]) makes a batch-sized tensor from nothing: maybe the batch, maybe not.
    nodes = [
        _const("shape", np.array([2, 4], np.int64)),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"]),
        helper.make_node("Add", ["x", "ones"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    result = passes.rewrite_batch(helper.make_model(graph))
    assert result.batch == 2 and result.rewritten == ()
    (line,) = result.unproven
    assert "ConstantOfShape" in line and "[2, 4]" in line
    with pytest.raises(ek.ModelError, match="fails at batch 3"):  # the lint is the final judge
        ek.lint_batch(result.model)


def test_convert_opset_up_and_model_still_matches():
    model = legacy_model()
    converted = passes.convert_opset(model, 13)
    assert ek.load_model(converted).opset == 13
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    for a, b in zip(_run(converted, {"x": x}), _run(model, {"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def _add_model(dtype: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", dtype, ["batch", 4])],
        [helper.make_tensor_value_info("y", dtype, ["batch", 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convert_opset_carries_ops_whose_new_version_only_widened_types():
    converted = passes.convert_opset(_add_model(TensorProto.FLOAT), 13)
    assert ek.load_model(converted).opset == 13 and [n.domain for n in converted.graph.node] == [
        "",
        "",
    ]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(_run(converted, {"x": x})[0], x + x)
    with pytest.raises(ek.ModelError, match=r"17 to 13: op 'Add' uses types"):
        passes.convert_opset(_add_model(TensorProto.INT8), 13)  # int8 Add is opset 14+


def _layernorm_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "s"], ["y"])],
        "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "s")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convert_opset_down_names_the_op_that_cannot_go():
    with pytest.raises(ek.ModelError, match=r"opset 17 to 16.*LayerNormalization"):
        passes.convert_opset(_layernorm_model(), 16)


@pytest.fixture
def ort_opset_11_13(monkeypatch):
    """The ONNX Runtime backend declaring that it accepts opsets 11..13 only."""
    fake = types.SimpleNamespace(
        NAME="ort13",
        OPTIONS=ort_backend.OPTIONS,
        OPSETS=(11, 13),
        available=lambda: backends.Availability("ort13", True, "1", ("cpu",)),
        build=ort_backend.build,
        load=ort_backend.load,
    )
    monkeypatch.setitem(backends._loaded, "ort13", fake)
    return "ort13"


def test_build_converts_to_backend_opsets_and_records_it(ort_opset_11_13):
    model = foldable_model()
    engine = ek.build(model, backend=ort_opset_11_13, shapes={"x": (2, 4)})
    simplify, convert = engine.manifest["passes"]  # simplify first: fewer ops to convert
    assert simplify["name"] == "simplify" and convert["name"] == "convert_opset"
    assert (convert["from"], convert["to"]) == (17, 13)
    assert convert["carried"] == ["Add", "Relu"]  # no 14 -> 13 adapters; only types differ
    assert engine.manifest["source"]["opset"] == 17
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(engine.infer(x)["y"], _run(model, {"x": x})[0], rtol=1e-5)


def test_build_refuses_when_opset_conversion_is_impossible(ort_opset_11_13):
    with pytest.raises(ek.BuildError, match=r"17 to 13.*LayerNormalization.*11\.\.13"):
        ek.build(_layernorm_model(), backend=ort_opset_11_13, shapes={"x": (2, 4)})


def test_build_selected_outputs_builds_the_subgraph():
    model = foldable_model()
    engine = ek.build(model, shapes={"x": (3, 4)}, outputs=["h", "bias"])
    assert [o.name for o in engine.outputs] == ["h", "bias"]
    assert engine.manifest["passes"][0]["name"] == "extract"
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    w = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(engine.infer(x)["h"], x @ w, rtol=1e-5)


def test_extract_unknown_output_suggests_close_names():
    with pytest.raises(ek.ModelError, match=r"'hbb'.*did you mean 'hb'"):
        passes.extract(foldable_model(), ["hbb"])
    with pytest.raises(ek.BuildError, match="outputs="):
        ek.build(foldable_model(), shapes={"x": (3, 4)}, outputs=["nope"])


def test_rename_inputs_and_outputs():
    renamed = passes.rename(foldable_model(), {"x": "features", "y": "scores"})
    assert [i.name for i in renamed.graph.input] == ["features"]
    assert [o.name for o in renamed.graph.output] == ["scores"]
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(
        _run(renamed, {"features": x})[0], _run(foldable_model(), {"x": x})[0]
    )
    with pytest.raises(ek.ModelError, match="already has a tensor 'h'"):
        passes.rename(foldable_model(), {"x": "h"})
    with pytest.raises(ek.ModelError, match="'z' is not a tensor"):
        passes.rename(foldable_model(), {"z": "w"})


def test_cli_prepare_makes_legacy_model_dynamic_and_converts_opset(tmp_path, capsys):
    from enginekit.cli import main

    src = tmp_path / "legacy.onnx"
    onnx.save(legacy_model(), src)
    out = tmp_path / "ready.onnx"
    code = main(
        [
            "prepare",
            str(src),
            "-o",
            str(out),
            "--batch-dynamic",
            "--opset",
            "13",
            "--rename",
            "logits=scores",
            "--json",
        ]
    )
    assert code == 0
    info = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in info["steps"]] == [
        "rename",
        "batch_dynamic",
        "simplify",
        "convert_opset",
    ]
    assert info["batch_lint"]["passed"] and info["opset"] == 13
    model = ek.load_model(out)
    assert [(s.name, s.shape[0]) for s in model.outputs] == [
        ("scores", "batch"),
        ("total", "batch"),
    ]
    x = np.random.default_rng(8).standard_normal((5, 3, 8, 8)).astype(np.float32)
    want = np.concatenate([_run(legacy_model(), {"x": x[i : i + 1]})[0] for i in range(5)])
    np.testing.assert_allclose(_run(model.proto, {"x": x})[0], want, rtol=1e-4)


def test_cli_build_flags_no_simplify_and_outputs(tmp_path, capsys):
    from enginekit.cli import main

    src = tmp_path / "f.onnx"
    onnx.save(foldable_model(), src)
    out = tmp_path / "f.ekit"
    code = main(
        [
            "build",
            str(src),
            "--shapes",
            "x:2x4",
            "--no-simplify",
            "--outputs",
            "hb,h",
            "-o",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    manifest = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in manifest["passes"]] == ["extract"]
    assert [o["name"] for o in manifest["outputs"]] == ["hb", "h"]
    assert main(["inspect", str(out)]) == 0
    assert "passes     extract 10->7 nodes" in capsys.readouterr().out


def test_build_without_onnxslim_records_why_and_still_builds(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "onnxslim", None)  # import onnxslim -> ImportError
    engine = ek.build(foldable_model(), shapes={"x": (2, 4)})
    (record,) = engine.manifest["passes"]
    assert record["name"] == "simplify" and record["nodes_after"] == record["nodes_before"]
    assert "pip install onnxslim" in record["error"]
    assert "graph simplification skipped" in caplog.text
    assert engine.manifest["verify"]["passed"]


def test_auto_backend_refuses_per_backend_pass_options():
    with pytest.raises(ek.BuildError, match="name the backend instead of 'auto'"):
        ek.build(foldable_model(), backend="auto", shapes={"x": (2, 4)}, simplify=False)
    with pytest.raises(ek.BuildError, match="name the backend instead of 'auto'"):
        ek.build(foldable_model(), backend="auto", shapes={"x": (2, 4)}, outputs=["h"])


def test_simplify_refuses_a_model_onnxslim_leaves_invalid_and_build_goes_on_without_it(tmp_path):
    # ONNX's own node case: onnxslim folds an If branch's outer-scope value away, leaving a
    # model ONNX Runtime refuses ("not a graph input, initializer, or output").
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case definitions compute their data with numpy
        cases = node.collect_testcases(None)
    case = next(c for c in cases if c.name == "test_affine_grid_2d_expanded")
    with pytest.raises(ek.ModelError, match="invalid model"):
        passes.simplify(case.model)
    inputs, outputs = case.data_sets[0]
    names = [i.name for i in case.model.graph.input]
    engine = ek.build(
        case.model,
        backend="onnxruntime",
        output=tmp_path / "m.ekit",
        verify_data=dict(zip(names, inputs)),
    )
    got = engine.infer(dict(zip(names, inputs)))
    np.testing.assert_allclose(next(iter(got.values())), outputs[0], rtol=1e-5, atol=1e-6)
