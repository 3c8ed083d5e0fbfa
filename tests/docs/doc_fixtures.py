"""The files and names every docs page's examples may use, made from tiny models.

tests/docs/test_docs_examples.py runs each page of README.md and docs/ in a fresh folder holding
a copy of what :func:`build` makes (built once per test session), with the Python blocks of a
page sharing one namespace that starts with :func:`namespace`. A page may use:

files
    ``model.onnx``  an MLP: ``x`` [batch, 16] -> ``hidden_0`` .. ``hidden_3`` -> ``output``
                    [batch, 10] (dynamic batch, opset 17)
    ``cnn.onnx``    a CNN: ``x`` [batch, 3, 16, 16] -> ``output`` [batch, 10]
    ``legacy.onnx`` the MLP as an old export: input ``input.1``, batch fixed to 1
    ``x.npy``       4 rows for ``x``; ``calib.npz`` 64 rows (key ``x``); ``val.npz`` 32 rows
    ``example.npy`` 2 rows for ``x`` (example inputs of an export)
    ``enginekit.toml``  a build file: model.onnx as ``classifier``, onnxruntime fp32 and int8
                    (calibrated on calib.npz), short bench; ``last/report.json`` is its report
    ``my_models.py`` ``make_classifier()`` returns ``(model, example_inputs)`` (PyTorch)
    ``train.py``    ``net``: a PyTorch module whose ``forward`` takes ``x`` [batch, 16]
names (Python blocks)
    ``x`` (4×16 float32), ``data`` (64×16, calibration), ``held_out`` (32×16);
    ``torch_model`` and ``example_x`` (a PyTorch MLP and a 1×16 example);
    ``encoder``, ``ids``, ``mask`` (a PyTorch token encoder and its two inputs).

A block that needs what this folder cannot give (a GPU, TensorRT, the network, a long run) is
preceded by the line ``<!-- no-run: reason -->``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RNG_SEED = 0


def _mlp(path: Path, input_name: str = "x", batch: int | str = "batch") -> None:
    rng = np.random.default_rng(RNG_SEED)
    weights = {
        "w1": rng.standard_normal((16, 32)) / 4,
        "b1": rng.standard_normal(32) / 4,
        "w2": rng.standard_normal((32, 10)) / 4,
        "b2": rng.standard_normal(10) / 4,
    }
    inits = [numpy_helper.from_array(w.astype(np.float32), k) for k, w in weights.items()]
    nodes = [
        helper.make_node("MatMul", [input_name, "w1"], ["hidden_0"]),
        helper.make_node("Add", ["hidden_0", "b1"], ["hidden_1"]),
        helper.make_node("Relu", ["hidden_1"], ["hidden_2"]),
        helper.make_node("MatMul", ["hidden_2", "w2"], ["hidden_3"]),
        helper.make_node("Add", ["hidden_3", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [batch, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 10])],
        inits,
    )
    _save(graph, path)


def _cnn(path: Path) -> None:
    rng = np.random.default_rng(RNG_SEED)
    weights = {
        "conv_w": rng.standard_normal((8, 3, 3, 3)) / 4,
        "conv_b": rng.standard_normal(8) / 4,
        "fc_w": rng.standard_normal((10, 8)) / 4,
        "fc_b": rng.standard_normal(10) / 4,
    }
    inits = [numpy_helper.from_array(w.astype(np.float32), k) for k, w in weights.items()]
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["output"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    _save(graph, path)


def _save(graph: onnx.GraphProto, path: Path) -> None:
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


TOML = """\
# enginekit.toml (the docs' example build file)
[model]
source = "model.onnx"
name = "classifier"

[shapes]
x = ["1x16", "8x16", "32x16"]

[[engine]]
backend = "onnxruntime"
precision = ["fp32", "int8"]

[calibration]
data = "calib.npz"

[gates]
max_abs_error = { fp32 = 1e-4, int8 = 0.5 }

[bench]
batch_sizes = [8]
duration = 0.2
"""

MY_MODELS = '''\
"""An exporter entry: a function returning (model, example_inputs)."""
import torch


def make_classifier():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return model.eval(), (torch.randn(2, 16),)
'''

TRAIN = '''\
"""A training script's module: `net` takes x [batch, 16]."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


torch.manual_seed(0)
net = Net().eval()
'''


def build(folder: Path) -> Path:
    """Write every fixture file into ``folder`` (the pipeline's report takes a few seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    _mlp(folder / "model.onnx")
    _mlp(folder / "legacy.onnx", input_name="input.1", batch=1)
    _cnn(folder / "cnn.onnx")
    rng = np.random.default_rng(RNG_SEED)
    np.save(folder / "x.npy", rng.standard_normal((4, 16)).astype(np.float32))
    np.save(folder / "example.npy", rng.standard_normal((2, 16)).astype(np.float32))
    np.savez(folder / "calib.npz", x=rng.standard_normal((64, 16)).astype(np.float32))
    np.savez(folder / "val.npz", x=rng.standard_normal((32, 16)).astype(np.float32))
    (folder / "enginekit.toml").write_text(TOML, encoding="utf-8")
    (folder / "my_models.py").write_text(MY_MODELS, encoding="utf-8")
    (folder / "train.py").write_text(TRAIN, encoding="utf-8")
    from enginekit import pipeline

    scratch = folder / ".scratch"
    report = pipeline.run(folder / "enginekit.toml", out=scratch)
    assert report["exit_code"] == 0, report
    (folder / "last").mkdir()
    shutil.copy(scratch / "report.json", folder / "last" / "report.json")
    shutil.rmtree(scratch)
    return folder


def copy_into(fixtures: Path, folder: Path) -> None:
    """A page's fresh folder: a copy of the fixtures."""
    shutil.copytree(fixtures, folder, dirs_exist_ok=True)


def namespace() -> dict[str, Any]:
    """The names a page's Python blocks start with (see the module docstring)."""
    rng = np.random.default_rng(RNG_SEED)
    ns: dict[str, Any] = {
        "__name__": "__docs__",
        "x": rng.standard_normal((4, 16)).astype(np.float32),
        "data": rng.standard_normal((64, 16)).astype(np.float32),
        "held_out": rng.standard_normal((32, 16)).astype(np.float32),
    }
    try:
        import torch
    except ImportError:  # pages that need torch fail on their own import
        return ns
    torch.manual_seed(0)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(30, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return (self.embed(input_ids) * attention_mask[..., None]).sum(1)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    ns.update(
        torch_model=Net().eval(),
        example_x=torch.randn(1, 16),
        encoder=Encoder().eval(),
        ids=torch.randint(0, 30, (2, 5)),
        mask=torch.ones(2, 5),
    )
    return ns


__all__ = ["build", "copy_into", "namespace"]
