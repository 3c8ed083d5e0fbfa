"""Model loading (external data kept inside the model's folder), IO specs, hashes, batch rewriting."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.model import io_specs


def fixed_batch_model(
    batch: int = 2, bake_reshape: bool = True, opset: int = 13
) -> onnx.ModelProto:
    """x[batch,4,4] -> Reshape to [batch,16] (batch baked into the constant) -> MatMul -> y."""
    w = numpy_helper.from_array(np.arange(16 * 3, dtype=np.float32).reshape(16, 3) / 10, "w")
    shape = numpy_helper.from_array(
        np.array([batch if bake_reshape else -1, 16], np.int64), "shape"
    )
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["flat"], name="flatten_reshape"),
        helper.make_node("MatMul", ["flat", "w"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        [w, shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_make_batch_dynamic_rewrites_io_and_baked_reshape():
    model = ek.make_batch_dynamic(fixed_batch_model())
    loaded = ek.load_model(model)
    assert loaded.inputs[0].shape == ("batch", 4, 4)
    assert loaded.outputs[0].shape == ("batch", 3)
    assert ek.lint_batch(model) == []
    x = np.random.default_rng(0).standard_normal((5, 4, 4)).astype(np.float32)
    engine = ek.build(model, shapes={"x": [(1, 4, 4), (4, 4, 4), (8, 4, 4)]})
    np.testing.assert_allclose(
        engine.infer(x)["y"],
        x.reshape(5, 16) @ (np.arange(48, dtype=np.float32).reshape(16, 3) / 10),
        rtol=1e-5,
    )


def test_lint_reports_output_that_ignores_batch():
    model = fixed_batch_model()
    for v in list(model.graph.input) + list(model.graph.output):
        v.type.tensor_type.shape.dim[0].dim_param = "batch"
    model.graph.node[0].input[1] = "shape"  # still baked: [2, 16] -> fails or mis-shapes at batch 3
    with pytest.raises(ek.ModelError, match="fails at batch"):
        ek.lint_batch(model)
    ok = fixed_batch_model(bake_reshape=False)
    for v in list(ok.graph.input) + list(ok.graph.output):
        v.type.tensor_type.shape.dim[0].dim_param = "batch"
    assert ek.lint_batch(ok) == []


def test_lint_flags_output_with_constant_leading_dim():
    # y = ReduceSum over the batch: its leading dim is 1 whatever the batch.
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    issues = ek.lint_batch(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    assert [(i.output, i.batch) for i in issues] == [("y", 3)]
    assert "does not follow the batch" in str(issues[0])


def test_io_specs_skip_initializers_listed_as_inputs():
    model = fixed_batch_model()
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [16, 3]))
    inputs, _ = io_specs(model)
    assert [s.name for s in inputs] == ["x"]


def test_hash_is_stable_and_content_based(tmp_path):
    model = fixed_batch_model()
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(model, a)
    onnx.save(model, b)
    assert ek.load_model(a).sha256 == ek.load_model(b).sha256
    changed = fixed_batch_model()
    changed.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(np.zeros((16, 3), np.float32), "w")
    )
    onnx.save(changed, b)
    assert ek.load_model(a).sha256 != ek.load_model(b).sha256


def _save_external(model: onnx.ModelProto, path, location: str) -> None:
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
    )


def test_external_data_inside_folder_loads_and_is_hashed(tmp_path):
    model = fixed_batch_model()
    _save_external(model, tmp_path / "m.onnx", "m.onnx.data")
    loaded = ek.load_model(tmp_path / "m.onnx")
    assert numpy_helper.to_array(loaded.proto.graph.initializer[0]).shape == (16, 3)
    before = loaded.sha256
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:-4] + b"\0\0\0\1")
    assert ek.load_model(tmp_path / "m.onnx").sha256 != before


def test_external_data_escaping_the_folder_is_refused(tmp_path):
    model = fixed_batch_model()
    inner = tmp_path / "models"
    inner.mkdir()
    _save_external(model, tmp_path / "m.onnx", "weights.bin")
    proto = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../weights.bin"
    onnx.save(proto, inner / "evil.onnx")
    with pytest.raises(ek.ModelError, match="escapes the model's folder"):
        ek.load_model(inner / "evil.onnx")
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = str(tmp_path / "weights.bin")
    onnx.save(proto, inner / "abs.onnx")
    with pytest.raises(ek.ModelError, match="escapes"):
        ek.load_model(inner / "abs.onnx")


def test_missing_or_garbage_model_files(tmp_path):
    with pytest.raises(ek.ModelError, match="no such ONNX file"):
        ek.load_model(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\xffnot a protobuf at all" * 10)
    with pytest.raises(ek.ModelError, match="not a readable ONNX model|holds no graph"):
        ek.load_model(bad)
    model = fixed_batch_model()
    _save_external(model, tmp_path / "m.onnx", "m.onnx.data")
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ek.ModelError, match="external data file 'm.onnx.data' is missing"):
        ek.load_model(tmp_path / "m.onnx")


def _two_inputs(batch="batch"):
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, "seq"])
        for n in ("input_ids", "attention_mask")
    ]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, "seq"])
    graph = helper.make_graph(
        [helper.make_node("Add", ["input_ids", "attention_mask"], ["out"])], "g", inputs, [out]
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto


def test_a_shared_symbolic_dim_with_different_ranges_is_refused_naming_the_dim():
    import enginekit as ek
    from enginekit.config import normalize_shapes
    from enginekit.model import check_profiles, load_model

    model = load_model(_two_inputs())
    bad = normalize_shapes("input_ids:1x8,4x32,8x64 attention_mask:1x8,4x16,8x64")
    with pytest.raises(ek.BuildError, match="share the dim 'seq'.*input_ids dim 1: 8,32,64"):
        check_profiles(model, bad)
    check_profiles(model, normalize_shapes("input_ids:1x8,4x32,8x64 attention_mask:1x8,4x32,8x64"))


def test_a_fixed_batch_with_a_batch_range_points_to_prepare_batch_dynamic():
    import enginekit as ek
    from enginekit.config import normalize_shapes
    from enginekit.model import check_profiles, load_model

    model = load_model(_two_inputs(batch=1))
    shapes = normalize_shapes("input_ids:1x8,4x8,8x8 attention_mask:1x8,4x8,8x8")
    with pytest.raises(
        ek.BuildError, match="fixes it to 1.*enginekit prepare MODEL -o OUT.onnx --batch-dynamic"
    ):
        check_profiles(model, shapes)
    with pytest.raises(ek.BuildError, match="did you mean 'input_ids'"):
        check_profiles(model, normalize_shapes("input_id:1x8 attention_mask:1x8"))


def test_random_feeds_for_a_zero_dimensional_string_input_is_an_array():
    from enginekit.engine import TensorSpec
    from enginekit.model import random_feeds

    feeds = random_feeds([TensorSpec("s", "object", ())], {"s": ()})
    assert (
        isinstance(feeds["s"], np.ndarray) and feeds["s"].shape == () and feeds["s"].dtype == object
    )
