"""Triton model repository entries: config.pbtxt parsed with Triton's own ModelConfig schema
and matched against the engine's IO specs; the ONNX payload and the Python-backend model.py
both serve what the engine serves."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.cli import main
from enginekit.errors import EnginekitError
from enginekit.pipeline.triton import config_pbtxt, export_triton, plan_model


def model_config():
    return pytest.importorskip(
        "tritonclient.grpc.model_config_pb2", reason="Triton's ModelConfig schema (test extra)"
    )


def parse(path: Path):
    """config.pbtxt parsed strictly (unknown fields and bad enum values raise)."""
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(encoding="utf-8"), model_config().ModelConfig())


@pytest.fixture(scope="module")
def mlp_artifact(mlp_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "mlp.ekit"
    ek.build(mlp_path, shapes={"x": [(1, 16), (4, 16), (8, 16)]}, output=out).close()
    return out


def test_onnxruntime_engine_becomes_an_onnxruntime_model(mlp_artifact, tmp_path):
    result = export_triton(mlp_artifact, tmp_path / "repo", max_queue_delay_us=250)
    config = parse(Path(result["config"]))
    assert config.name == "mlp" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 8
    (x,) = config.input
    (y,) = config.output
    assert (x.name, list(x.dims), x.data_type) == (
        "x",
        [16],
        model_config().DataType.Value("TYPE_FP32"),
    )
    assert (y.name, list(y.dims)) == ("output", [4])
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    assert config.instance_group[0].kind == config.instance_group[0].Kind.Value("KIND_CPU")
    payload = Path(result["model_dir"]) / "1" / "model.onnx"
    assert result["files"] == ["config.pbtxt", "1/model.onnx"]
    # Triton's ONNX Runtime backend runs this file: it must compute what the engine computes.
    import onnxruntime as ort

    feeds = {"x": np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)}
    (got,) = ort.InferenceSession(str(payload), providers=["CPUExecutionProvider"]).run(None, feeds)
    with ek.load(mlp_artifact) as engine:
        np.testing.assert_allclose(got, engine.infer(feeds)["output"], rtol=1e-6, atol=1e-6)


def test_rewriting_a_version_replaces_it_and_keeps_others(mlp_artifact, tmp_path):
    repo = tmp_path / "repo"
    export_triton(mlp_artifact, repo, version=1)
    export_triton(mlp_artifact, repo, version=2, max_batch_size=4)
    model_dir = repo / "mlp"
    assert sorted(p.name for p in model_dir.iterdir()) == ["1", "2", "config.pbtxt"]
    assert parse(model_dir / "config.pbtxt").max_batch_size == 4


def test_multi_input_model_dims_follow_each_spec(onnx_model, tmp_path):
    art = tmp_path / "two.ekit"
    shapes = {"a": [(1, 8), (4, 8), (8, 8)], "b": [(1, 4), (4, 4), (8, 4)]}
    ek.build(onnx_model("two_input"), shapes=shapes, output=art).close()
    config = parse(Path(export_triton(art, tmp_path / "repo")["config"]))
    with ek.load(art) as engine:
        for t, spec in zip(
            list(config.input) + list(config.output), engine.inputs + engine.outputs
        ):
            assert t.name == spec.name
            assert list(t.dims) == [d if isinstance(d, int) else -1 for d in spec.shape[1:]]


def test_sequence_dim_is_variable_unless_every_profile_fixes_it():
    manifest = {
        "backend": {"name": "onnxruntime", "metadata": {}},
        "payload": {"model.onnx": {}},
        "config": {"device": "cuda:0"},
        "inputs": [{"name": "ids", "dtype": "int64", "shape": ["batch", "seq"]}],
        "outputs": [{"name": "y", "dtype": "float16", "shape": ["batch", "seq", 3]}],
        "profiles": [{"ids": [[1, 2], [4, 8], [8, 12]]}],
    }
    model = plan_model(manifest, "enc")
    assert model.inputs[0].dims == (-1,) and model.outputs[0].dims == (-1, 3)
    assert model.instance_kind == "KIND_GPU" and model.max_batch_size == 8
    manifest["profiles"] = [{"ids": [[1, 16], [4, 16], [8, 16]]}]
    assert plan_model(manifest, "enc").inputs[0].dims == (16,)
    text = config_pbtxt(plan_model(manifest, "enc"))
    assert "data_type: TYPE_INT64" in text and "data_type: TYPE_FP16" in text


def test_tensorrt_engine_becomes_a_plan_model():
    manifest = {
        "backend": {"name": "tensorrt", "metadata": {}},
        "payload": {"model.plan": {}, "timing.cache": {}},
        "config": {"device": "cuda"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 10]}],
        "profiles": [{"x": [[1, 3, 8, 8], [8, 3, 8, 8], [32, 3, 8, 8]]}],
    }
    model = plan_model(manifest, "cnn")
    assert (model.platform, model.model_file, model.max_batch_size) == (
        "tensorrt_plan",
        "model.plan",
        32,
    )
    assert model.preferred_batch_sizes == (8,)


def test_model_without_batch_dim_has_max_batch_size_0(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "fixed.onnx")
    ek.build(tmp_path / "fixed.onnx", output=tmp_path / "fixed.ekit").close()
    config = parse(Path(export_triton(tmp_path / "fixed.ekit", tmp_path / "repo")["config"]))
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [2, 3]
    assert not config.HasField("dynamic_batching")


class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


def _pb_utils() -> types.ModuleType:
    """The few names of Triton's triton_python_backend_utils that model.py uses (Triton's
    server cannot run here)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor = _Tensor
    pb.get_input_tensor_by_name = lambda request, name: next(
        (t for t in request if t.name() == name), None
    )
    pb.TritonError = lambda message: message
    pb.InferenceResponse = lambda output_tensors, error=None: types.SimpleNamespace(
        output_tensors=output_tensors, error=error
    )
    return pb


def test_other_backends_run_in_the_python_backend(mlp_path, tmp_path, broken_backend, monkeypatch):
    art = tmp_path / "b.ekit"
    ek.build(
        mlp_path,
        backend="broken",
        shapes={"x": [(1, 16), (4, 16), (8, 16)]},
        verify=False,
        output=art,
    ).close()
    result = export_triton(art, tmp_path / "repo", name="b")
    config = parse(Path(result["config"]))
    assert config.backend == "python" and config.platform == ""
    assert result["files"] == ["config.pbtxt", "1/model.ekit", "1/model.py"]
    assert any("Python backend" in n for n in result["notes"])

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    namespace: dict = {}
    version_dir = tmp_path / "repo" / "b" / "1"
    exec(compile((version_dir / "model.py").read_text(), "model.py", "exec"), namespace)
    served = namespace["TritonPythonModel"]()
    served.initialize({"model_repository": str(version_dir.parent), "model_version": "1"})
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    good, bad = served.execute([[_Tensor("x", x)], [_Tensor("x", x.astype(np.float64))]])
    served.finalize()
    with ek.load(art) as engine:
        np.testing.assert_array_equal(good.output_tensors[0].as_numpy(), engine.infer(x)["output"])
    assert good.error is None and "EngineInputError" in bad.error


def test_export_triton_command(mlp_artifact, tmp_path, capsys):
    assert (
        main(["export-triton", str(mlp_artifact), "--repo", str(tmp_path / "r"), "--name", "m"])
        == 0
    )
    out = capsys.readouterr().out
    assert "onnxruntime_onnx, max_batch_size 8" in out and "1/model.onnx" in out
    assert (
        main(["export-triton", str(mlp_artifact), "--repo", str(tmp_path / "r"), "--name", "a/b"])
        == 1
    )


def test_bad_names_and_versions_are_refused(mlp_artifact, tmp_path):
    with pytest.raises(EnginekitError, match="Triton model name"):
        export_triton(mlp_artifact, tmp_path, name="a b")
    with pytest.raises(EnginekitError, match="version 0"):
        export_triton(mlp_artifact, tmp_path, version=0)
    with pytest.raises(ek.ArtifactError):
        export_triton(tmp_path / "missing.ekit", tmp_path)
