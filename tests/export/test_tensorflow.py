"""TensorFlow / Keras -> ONNX: export, build on ONNX Runtime, match TensorFlow at batch 1 and 7.

TensorFlow takes ~10 s to import: every test here shares one module-scoped import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import enginekit as ek
from enginekit.export import tensorflow as tf_export

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    pytest.importorskip("tf2onnx", reason="TensorFlow export needs tf2onnx (enginekit[tf])")
    tf = pytest.importorskip("tensorflow", reason="TensorFlow export needs enginekit[tf]")
    import keras

    keras.utils.set_random_seed(0)
    return tf


@pytest.fixture(scope="module")
def keras(tf):
    import keras

    return keras


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _build_and_match(onnx_path, reference, shapes, tmp_path, batches=(1, 7)):
    """Build on ONNX Runtime, reload the artifact, and compare with TensorFlow at each batch."""
    ek.build(onnx_path, shapes=shapes, output=tmp_path / "engine.ekit")
    engine = ek.load(tmp_path / "engine.ekit")
    rng = np.random.default_rng(7)
    for batch in batches:
        feeds = {}
        for name, (_, opt, _) in shapes.items():
            feeds[name] = rng.standard_normal((batch, *opt[1:])).astype(np.float32)
        want = reference(feeds)
        got = engine.infer(feeds)
        assert list(got) == list(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    return engine


def test_tf_function_mlp_matches_tensorflow_at_batch_1_and_7(tf, tmp_path):
    rng = np.random.default_rng(0)
    w1 = tf.Variable(rng.standard_normal((16, 32)).astype(np.float32))
    w2 = tf.Variable(rng.standard_normal((32, 4)).astype(np.float32))
    # An eager tensor captured by closure: tf2onnx makes it a graph input unless fixed.
    bias = tf.constant(rng.standard_normal(32).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    def mlp(x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + bias), w2)

    path = ek.export(mlp, None, tmp_path / "mlp.onnx")
    model = onnx.load(path)
    assert [(i.name, _dims(i)) for i in model.graph.input] == [("x", ["batch", 16])]
    assert [(o.name, _dims(o)) for o in model.graph.output] == [("output", ["batch", 4])]
    _build_and_match(
        path,
        lambda f: {"output": mlp(f["x"]).numpy()},
        {"x": [(1, 16), (4, 16), (8, 16)]},
        tmp_path,
    )


def test_keras_sequential_cnn_matches_tensorflow_at_batch_1_and_7(keras, tmp_path):
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((12, 12, 3), name="image"),
            layers.Conv2D(8, 3, activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Conv2D(8, 3, padding="same", activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dropout(0.5),
            layers.Dense(5),
        ]
    )
    bn = model.layers[1]
    bn.moving_mean.assign(np.linspace(-0.5, 0.5, 8).astype(np.float32))
    bn.moving_variance.assign(np.linspace(0.5, 2.0, 8).astype(np.float32))
    path = ek.export(model, None, tmp_path / "cnn.onnx")
    _build_and_match(
        path,
        lambda f: {"output": model(f["image"], training=False).numpy()},
        {"image": [(1, 12, 12, 3), (4, 12, 12, 3), (8, 12, 12, 3)]},
        tmp_path,
    )


def test_keras_functional_two_inputs_two_outputs_in_model_order(keras, tmp_path):
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([a, b])
    model = keras.Model(
        [a, b], [keras.layers.Dense(3, name="score")(h), keras.layers.Dense(2, name="aux")(a)]
    )
    path = ek.export(model, None, tmp_path / "two.onnx")
    proto = onnx.load(path)
    assert [i.name for i in proto.graph.input] == ["a", "b"]
    assert [o.name for o in proto.graph.output] == ["score", "aux"]

    def reference(f):
        score, aux = model([f["a"], f["b"]], training=False)
        return {"score": score.numpy(), "aux": aux.numpy()}

    _build_and_match(
        path, reference, {"a": [(1, 6), (4, 6), (8, 6)], "b": [(1, 4), (4, 4), (8, 4)]}, tmp_path
    )


def test_savedmodel_directory_matches_tensorflow_at_batch_1_and_7(tf, tmp_path):
    class Scorer(tf.Module):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.w = tf.Variable(rng.standard_normal((10, 3)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 10], tf.float32, name="features")])
        def __call__(self, features):
            return {"probs": tf.nn.softmax(tf.matmul(features, self.w))}

    scorer = Scorer()
    tf.saved_model.save(scorer, str(tmp_path / "saved"), signatures=scorer.__call__)
    assert tf_export.accepts(tmp_path / "saved")
    path = ek.export(tmp_path / "saved", None, tmp_path / "saved.onnx")
    assert [o.name for o in onnx.load(path).graph.output] == ["probs"]
    with pytest.raises(ek.ExportError, match="no signature 'predict'; it has: serving_default"):
        ek.export(tmp_path / "saved", None, tmp_path / "x.onnx", signature="predict")
    _build_and_match(
        path,
        lambda f: {"probs": scorer(f["features"])["probs"].numpy()},
        {"features": [(1, 10), (4, 10), (8, 10)]},
        tmp_path,
    )


def test_keras_file_path_exports(keras, tmp_path):
    model = keras.Sequential([keras.Input((5,), name="x"), keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    path = ek.export(str(tmp_path / "m.keras"), None, tmp_path / "m.onnx")
    x = np.ones((3, 5), np.float32)
    got = ek.build(path, shapes={"x": (3, 5)}).infer(x)["output"]
    np.testing.assert_allclose(got, model(x).numpy(), rtol=RTOL, atol=ATOL)


def test_dropout_model_exports_in_inference_mode_deterministically(keras, tmp_path):
    model = keras.Sequential(
        [keras.Input((8,), name="x"), keras.layers.Dense(8), keras.layers.Dropout(0.9)]
    )
    path = ek.export(model, None, tmp_path / "drop.onnx")
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert not any("Random" in op or "Dropout" in op for op in ops)
    engine = ek.build(path, shapes={"x": (4, 8)})
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    first, second = engine.infer(x)["output"], engine.infer(x)["output"]
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, model(x, training=False).numpy(), rtol=RTOL, atol=ATOL)


def test_function_calling_keras_in_training_mode_is_refused(tf, keras, tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5)])

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def train_step(x):
        return model(x, training=True)

    with pytest.raises(ek.ExportError, match=r"random numbers.*training=False"):
        ek.export(train_step, None, tmp_path / "t.onnx")
    assert not (tmp_path / "t.onnx").exists()


def test_signatureless_function_needs_example_inputs(tf, tmp_path):
    @tf.function
    def f(x, y):
        return x * 2.0 + tf.reduce_sum(y, axis=1, keepdims=True)

    with pytest.raises(ek.ExportError, match="no input_signature.*example inputs"):
        ek.export(f, None, tmp_path / "f.onnx")
    x, y = np.ones((2, 3), np.float32), np.ones((2, 5), np.float32)
    proto = onnx.load(ek.export(f, (x, y), tmp_path / "f.onnx"))
    assert [(i.name, _dims(i)) for i in proto.graph.input] == [
        ("x", ["batch", 3]),
        ("y", ["batch", 5]),
    ]


def test_path_that_is_not_a_savedmodel_is_refused(tf, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    assert not tf_export.accepts(tmp_path)
    with pytest.raises(ek.ExportError, match=r"no exporter accepts the path.*saved_model\.pb"):
        ek.export(tmp_path, None, tmp_path / "x.onnx")
    with pytest.raises(ek.ExportError, match=r"not a SavedModel \(a directory holding notes\.txt"):
        tf_export.export(tmp_path, None, tmp_path / "x.onnx")


def test_op_tf2onnx_cannot_convert_is_named(tf, tmp_path):
    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def spectrum(x):
        return tf.math.real(tf.signal.fft(tf.complex(x, x)))

    with pytest.raises(ek.ExportError, match=r"cannot convert the TensorFlow op\(s\) Complex"):
        ek.export(spectrum, None, tmp_path / "fft.onnx")


def test_mismatch_reports_the_largest_difference(tf, tmp_path):
    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32, name="x")])
    def f(x):
        return tf.math.erf(x) * tf.math.tanh(x) + tf.nn.softmax(x)

    # ONNX Runtime and TensorFlow round erf/tanh/softmax differently in the last bits.
    with pytest.raises(ek.ExportError, match=r"output 'output' differs by up to \d\.\d+e-0[67]"):
        ek.export(f, None, tmp_path / "f.onnx", atol=0.0, rtol=0.0)


def test_dynamic_dims_are_named_and_shared(tf, keras, tmp_path):
    embed = keras.layers.Embedding(20, 8)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, None], tf.int64, name="ids"),
            tf.TensorSpec([None, None], tf.float32, name="mask"),
        ]
    )
    def encode(ids, mask):
        h = embed(ids) * mask[..., None]
        return {"pooled": tf.reduce_sum(h, axis=1), "tokens": h}

    path = ek.export(
        encode, None, tmp_path / "e.onnx", dynamic_dims={"ids": {1: "seq"}, "mask": {1: "seq"}}
    )
    proto = onnx.load(path)
    assert [_dims(i) for i in proto.graph.input] == [["batch", "seq"], ["batch", "seq"]]
    assert {o.name: _dims(o) for o in proto.graph.output} == {
        "pooled": ["batch", 8],
        "tokens": ["batch", "seq", 8],
    }
    with pytest.raises(ek.ExportError, match=r"dynamic_dims name \['idz'\]"):
        ek.export(encode, None, tmp_path / "x.onnx", dynamic_dims={"idz": {1: "seq"}})


def test_traced_function_with_fixed_batch_cannot_be_made_dynamic(tf, tmp_path):
    @tf.function(input_signature=[tf.TensorSpec([2, 4], tf.float32, name="x")])
    def f(x):
        return tf.reshape(x, [2, 2, 2])

    with pytest.raises(ek.ExportError, match="fixes dim 0 of input 'x' to 2"):
        ek.export(f.get_concrete_function(), None, tmp_path / "f.onnx")
    with pytest.raises(ek.ExportError, match="TensorFlow itself fails.*dynamic_batch=False"):
        ek.export(f, None, tmp_path / "f.onnx")
    proto = onnx.load(ek.export(f, None, tmp_path / "f.onnx", dynamic_batch=False))
    assert _dims(proto.graph.input[0]) == [2, 4]


def test_bad_options_are_refused(tf, tmp_path):
    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def f(x):
        return x + 1.0, x - 1.0

    with pytest.raises(ek.ExportError, match="opsets 9..18"):
        ek.export(f, None, tmp_path / "f.onnx", opset=20)
    with pytest.raises(ek.ExportError, match="output_names.*returns 2 outputs"):
        ek.export(f, None, tmp_path / "f.onnx", output_names=["only"])
    proto = onnx.load(
        ek.export(f, None, tmp_path / "f.onnx", output_names=["up", "down"], opset=13)
    )
    assert [o.name for o in proto.graph.output] == ["up", "down"]
    assert ek.load_model(proto).opset == 13
    # numpy's default float64 examples are cast to the signature's float32; ints are not
    ek.export(f, np.zeros((3, 4)), tmp_path / "f64.onnx")
    with pytest.raises(ek.ExportError, match="example input 'x' is int64; .* takes float32"):
        ek.export(f, np.zeros((3, 4), np.int64), tmp_path / "i64.onnx")
    with pytest.raises(ek.ExportError, match="example inputs features for .* takes 1: x"):
        ek.export(f, {"features": np.zeros((3, 4))}, tmp_path / "named.onnx")


def test_accepts_paths_without_importing_tensorflow(tmp_path):
    (tmp_path / "sm").mkdir()
    (tmp_path / "sm" / "saved_model.pb").write_bytes(b"")
    code = (
        "import sys, enginekit\n"
        "from enginekit.export import tensorflow as t\n"
        f"assert t.accepts({str(tmp_path / 'sm')!r}) and t.accepts('m.keras')\n"
        f"assert not t.accepts({str(tmp_path)!r}) and not t.accepts('m.onnx')\n"
        "assert not t.accepts(object())\n"
        "try:\n"
        f"    t.export({str(tmp_path)!r}, None, 'x.onnx')\n"
        "except enginekit.ExportError as e:\n"
        "    assert 'not a SavedModel' in str(e)\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_cli_exports_savedmodel_dir_and_module_function(tf, tmp_path, monkeypatch, capsys):
    from enginekit.cli import main

    class Doubler(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": x * 2.0}

    doubler = Doubler()
    tf.saved_model.save(doubler, str(tmp_path / "sm"), signatures=doubler.__call__)
    assert main(["export", str(tmp_path / "sm"), "-o", str(tmp_path / "sm.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 3]}]
    assert info["outputs"][0]["name"] == "y" and info["checked"]

    (tmp_path / "zoo.py").write_text(
        "import keras\n"
        "def make_model():\n"
        "    return keras.Sequential([keras.Input((4,), name='x'), keras.layers.Dense(2)])\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "zoo", raising=False)
    assert main(["export", "zoo:make_model", "-o", "zoo.onnx", "--output-names", "z"]) == 0
    assert "exported zoo.onnx (opset 18, checked" in capsys.readouterr().out
    assert [o.name for o in onnx.load(tmp_path / "zoo.onnx").graph.output] == ["z"]
    assert main(["export", "zoo:nothing", "-o", "x.onnx"]) == 2
    assert "cannot load it" in capsys.readouterr().err


def test_dict_signature_inputs_are_named_by_key(tf, tmp_path):
    spec = {"b": tf.TensorSpec([None, 2], tf.float32), "a": tf.TensorSpec([None, 3], tf.float32)}

    @tf.function(input_signature=[spec])
    def f(features):
        return tf.concat([features["a"], features["b"]], axis=1)

    proto = onnx.load(ek.export(f, None, tmp_path / "d.onnx"))
    assert [(i.name, _dims(i)) for i in proto.graph.input] == [
        ("a", ["batch", 3]),
        ("b", ["batch", 2]),
    ]
    a, b = np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32)
    got = ek.build(proto, shapes={"a": (2, 3), "b": (2, 2)}).infer({"a": a, "b": b})["output"]
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=1))


def test_docs_export_examples_run(tf, tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="docs/export.md also exports a PyTorch model")
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/export.md", "exec"), namespace)
    assert namespace["probs"].shape == (3, 4)
    for name in ("net", "classify", "cnn", "cnn_from_file", "cnn_from_savedmodel", "pool"):
        assert (tmp_path / f"{name}.onnx").is_file(), name


def test_subclassed_keras_model_takes_its_inputs_from_examples(keras, tmp_path):
    class Head(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x) * 2.0

    model = Head()
    with pytest.raises(ek.ExportError, match="no defined inputs.*example"):
        ek.export(model, None, tmp_path / "h.onnx")
    x = np.random.default_rng(3).standard_normal((2, 5))  # float64, as numpy makes it
    proto = onnx.load(ek.export(model, x, tmp_path / "h.onnx"))
    (inp,) = proto.graph.input
    assert _dims(inp) == ["batch", 5] and inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    named = onnx.load(ek.export(model, {"features": x}, tmp_path / "h2.onnx"))
    assert [i.name for i in named.graph.input] == ["features"]  # a dict names the inputs


def test_an_export_after_the_users_own_keras_import_writes_nothing_to_stderr(tmp_path):
    code = (
        "import sys, keras, enginekit as ek\n"
        "m = keras.Sequential([keras.Input((8, 8, 1), name='image'), keras.layers.Conv2D(2, 3),\n"
        "                      keras.layers.Flatten(), keras.layers.Dense(3)])\n"
        "print('--- export', file=sys.stderr, flush=True)\n"
        "ek.export(m, None, 'k.onnx')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.split("--- export", 1)[1].strip() == ""
