"""PyTorch export: dynamic batch and named dims, the eager check, and bad inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import enginekit as ek

torch = pytest.importorskip("torch")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).softmax(-1)


def dims(path, kind="input"):
    proto = onnx.load(path)
    values = proto.graph.input if kind == "input" else proto.graph.output
    return {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values
    }


def test_batch_one_example_still_exports_dynamic_batch(tmp_path):
    path = ek.export(Tiny(), (torch.randn(1, 6),), tmp_path / "tiny.onnx")
    assert dims(path) == {"x": ["batch", 6]}
    assert dims(path, "output") == {"output": ["batch", 3]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]  # single file, no sidecar
    engine = ek.build(path, shapes={"x": [(1, 6), (4, 6), (9, 6)]})
    x = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
    want = Tiny.forward(_same_weights(path), torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(engine.infer(x)["output"], want, atol=1e-6)


def _same_weights(path):
    model = Tiny()
    init = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    with torch.no_grad():
        model.fc.weight.copy_(torch.from_numpy(init["fc.weight"].copy()))
        model.fc.bias.copy_(torch.from_numpy(init["fc.bias"].copy()))
    return model


def test_named_dims_by_forward_argument(onnx_model):
    path = onnx_model("transformer")
    assert dims(path) == {"ids": ["batch", "seq"], "mask": ["batch", "seq"]}


def test_static_export_and_output_names(tmp_path):
    path = ek.export(
        Tiny(), torch.randn(2, 6), tmp_path / "s.onnx", dynamic_batch=False, output_names=["probs"]
    )
    assert dims(path) == {"x": [2, 6]} and dims(path, "output") == {"probs": [2, 3]}


def test_mismatch_with_eager_raises_export_error_with_difference(tmp_path):
    class Noisy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)  # ONNX RandomUniformLike draws other numbers

    with pytest.raises(
        ek.ExportError, match="does not match PyTorch: output 'output' differs by up to"
    ):
        ek.export(Noisy(), torch.zeros(3, 4), tmp_path / "noisy.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dynamic_dims": {"y": {1: "seq"}}}, "not forward\\(\\) inputs \\(x\\)"),
        ({"dynamic_dims": {"x": {5: "seq"}}}, "axis 5; the input has rank 2"),
        ({"output_names": ["a", "b"]}, "output_names has 2 names"),
        ({"opset": 11}, "opset 11"),
    ],
)
def test_bad_export_options(tmp_path, kwargs, message):
    with pytest.raises(ek.ExportError, match=message):
        ek.export(Tiny(), torch.randn(2, 6), tmp_path / "m.onnx", **kwargs)


def test_non_tensor_inputs_and_unknown_models(tmp_path):
    with pytest.raises(ek.ExportError, match="must be tensors"):
        ek.export(Tiny(), ([1.0] * 6,), tmp_path / "m.onnx")
    with pytest.raises(ek.ExportError, match="no exporter accepts a builtins.dict"):
        ek.export({"not": "a model"}, None, tmp_path / "m.onnx")


def test_unexportable_model_raises_export_error(tmp_path):
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # control flow on data: torch.export refuses
                return x * 2
            return x

    with pytest.raises(ek.ExportError, match="torch.onnx.export failed"):
        ek.export(DataDependent(), torch.randn(2, 3), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
