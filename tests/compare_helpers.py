"""Helpers for the compare/bench/auto tests: model variants and running the CLI.

Variants are made from a tiny ONNX model with onnx.helper:

- ``changed_weight``: one weight element changed — a deliberately broken engine.
- ``nan_weight``: one weight element set to NaN — an engine that outputs NaN.
- ``padded``: the same outputs plus extra work (a chain of large MatMuls whose result is added
  times zero) — an equivalent but clearly slower engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


def tiny_mlp(
    dst: Path, features: int = 16, hidden: int = 32, classes: int = 10, input: str = "x"
) -> Path:
    """x[batch, features] -> MatMul, Add, Relu, MatMul, Add -> output[batch, classes] (opset 17)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            rng.standard_normal((features, hidden)).astype(np.float32) / 4, "w1"
        ),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32) / 4, "b1"),
        numpy_helper.from_array(
            rng.standard_normal((hidden, classes)).astype(np.float32) / 4, "w2"
        ),
        numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32) / 4, "b2"),
    ]
    nodes = [
        helper.make_node("MatMul", [input, "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info(input, onnx.TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    onnx.save(proto, str(dst))
    return dst


def mlp_weights(path: Path) -> dict[str, np.ndarray]:
    """The tiny MLP's weights by name (w1, b1, w2, b2)."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def torch_mlp(path: Path):
    """The tiny MLP at ``path`` as a torch module: the "source framework model" reference."""
    import torch

    w = {k: v.copy() for k, v in mlp_weights(path).items()}  # torch wants writable arrays
    first, second = torch.nn.Linear(*w["w1"].shape), torch.nn.Linear(*w["w2"].shape)
    with torch.no_grad():
        first.weight.copy_(torch.from_numpy(w["w1"].T.copy()))
        first.bias.copy_(torch.from_numpy(w["b1"]))
        second.weight.copy_(torch.from_numpy(w["w2"].T.copy()))
        second.bias.copy_(torch.from_numpy(w["b2"]))
    return torch.nn.Sequential(first, torch.nn.ReLU(), second).eval()


def _weight(proto: onnx.ModelProto) -> onnx.TensorProto:
    """The first float initializer with at least two dims (a layer's weight)."""
    for t in proto.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2:
            return t
    raise ValueError("the model has no float weight matrix")


def _set_first(proto: onnx.ModelProto, fn) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    t = _weight(out)
    values = numpy_helper.to_array(t).copy()
    values.flat[0] = fn(values.flat[0])
    t.CopyFrom(numpy_helper.from_array(values, t.name))
    return out


def changed_weight(src: Path, dst: Path, delta: float = 0.5) -> Path:
    """A copy of ``src`` with one weight element moved by ``delta``."""
    onnx.save(_set_first(onnx.load(str(src)), lambda v: v + delta), str(dst))
    return dst


def nan_weight(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with one weight element set to NaN."""
    onnx.save(_set_first(onnx.load(str(src)), lambda v: np.float32("nan")), str(dst))
    return dst


def padded(src: Path, dst: Path, width: int = 768, layers: int = 4) -> Path:
    """``src`` plus ``layers`` tanh(MatMul) of ``width`` on its first input, added times 0 to
    its first output: the same numbers, many times the work."""
    proto = onnx.load(str(src))
    graph = proto.graph
    x = graph.input[0]
    features = x.type.tensor_type.shape.dim[-1].dim_value
    out_name = graph.output[0].name
    for node in graph.node:
        node.output[:] = [f"{o}__pre" if o == out_name else o for o in node.output]
    rng = np.random.default_rng(0)
    prev, cur = x.name, features
    for i in range(layers):
        w = (rng.standard_normal((cur, width)) / np.sqrt(cur)).astype(np.float32)
        graph.initializer.append(numpy_helper.from_array(w, f"pad_w{i}"))
        graph.node.append(helper.make_node("MatMul", [prev, f"pad_w{i}"], [f"pad_m{i}"]))
        graph.node.append(helper.make_node("Tanh", [f"pad_m{i}"], [f"pad_t{i}"]))
        prev, cur = f"pad_t{i}", width
    graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "pad_zero"))
    graph.node.append(helper.make_node("ReduceSum", [prev], ["pad_sum"], keepdims=1))
    graph.node.append(helper.make_node("Mul", ["pad_sum", "pad_zero"], ["pad_nil"]))
    graph.node.append(helper.make_node("Add", [f"{out_name}__pre", "pad_nil"], [out_name]))
    onnx.checker.check_model(proto)
    onnx.save(proto, str(dst))
    return dst


ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m enginekit.cli ARGS`` on this checkout's enginekit; text output captured.

    tests/plugins is on the path: the never-available backend ``absent`` is registered."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "plugins")])
    env = {**os.environ, "PYTHONPATH": path, "ENGINEKIT_QUIET": "1"}
    return subprocess.run(
        [sys.executable, "-m", "enginekit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def stdout_json(proc: subprocess.CompletedProcess) -> Any:
    """The JSON a command printed, with its stderr in the failure message when it is not JSON."""
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        message = f"not JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        raise AssertionError(message) from None
