"""Tiny models and fixtures for the calibration tests: a residual CNN built with onnx.helper (no
torch), calibration data for it, and its calibration table. Test modules re-export the fixtures
they use (`tiny_table = calib_models.tiny_table`): a conftest.py here would shadow the
`conftest` module the top-level tests import from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek


def tiny_cnn(seed: int = 0, classes: int = 4, size: int = 8) -> onnx.ModelProto:
    """x[batch,3,size,size] -> Conv+Relu -> Conv -> Add(residual) -> Relu -> GAP -> Flatten ->
    Gemm."""
    rng = np.random.default_rng(seed)

    def init(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [
            init("w1", 8, 3, 3, 3),
            init("b1", 8, scale=0.1),
            init("w2", 8, 8, 3, 3, scale=0.2),
            init("b2", 8, scale=0.1),
            init("wf", classes, 8),
            init("bf", classes, scale=0.1),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="session")
def tiny_cnn_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "tiny_cnn.onnx"
    onnx.save_model(tiny_cnn(), str(path))
    return path


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "other.onnx"
    onnx.save_model(tiny_cnn(seed=1), str(path))
    return path


@pytest.fixture(scope="session")
def calib_x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((64, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="session")
def tiny_table(tiny_cnn_path: Path, calib_x: np.ndarray) -> ek.CalibrationTable:
    return ek.calibrate(tiny_cnn_path, calib_x, method="entropy", batch_size=16)


def two_gemm(w1: np.ndarray, w2: np.ndarray, names: tuple[str, str], graph: str) -> onnx.ModelProto:
    """x[batch,K] -> Gemm ``names[0]`` (w1, zero bias) -> h -> Gemm ``names[1]`` (w2, zero bias)
    -> logits[batch,N]: the two-layer MLP the accuracy-search tests shape by their weights."""
    inits = [
        numpy_helper.from_array(w1.astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(w1.shape[1], np.float32), "b1"),
        numpy_helper.from_array(w2.astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(w2.shape[1], np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name=names[0]),
        helper.make_node("Gemm", ["h", "w2", "b2"], ["logits"], name=names[1]),
    ]
    io = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", w1.shape[0]]),
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", w2.shape[1]]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, graph, io[:1], io[1:], inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    return model
