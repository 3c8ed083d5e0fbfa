"""enginekit's RNN/GRU/LSTM converters for TVM (enginekit/backends/tvm/rnn.py): TVM 0.27's
Relax importer has none ("cannot convert op 'LSTM'")."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import matches_reference
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

SEQ, BATCH, IN, HIDDEN = 3, 2, 4, 5


def _model(tmp_path, node, gates, dirs, seq=SEQ, extra=()):
    """One recurrent node; weights are initializers, X (and ``extra``) graph inputs."""
    rng = np.random.default_rng(0)
    weights = {
        "W": rng.standard_normal((dirs, gates * HIDDEN, IN)),
        "R": rng.standard_normal((dirs, gates * HIDDEN, HIDDEN)) * 0.5,
        "B": rng.standard_normal((dirs, 2 * gates * HIDDEN)),
        "P": rng.standard_normal((dirs, 3 * HIDDEN)),
    }
    init = [
        onnx.numpy_helper.from_array(v.astype(np.float32), k)
        for k, v in weights.items()
        if k in node.input
    ]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, (seq, BATCH, IN)), *extra]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output if o]
    graph = helper.make_graph([node], "g", inputs, outputs, init)
    path = tmp_path / f"{node.op_type}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), path)
    return path


def _check(path, feeds):
    matches_reference(path, feeds, "tvm", rtol=1e-4, atol=1e-5)


def _x():
    return np.random.default_rng(1).standard_normal((SEQ, BATCH, IN)).astype(np.float32)


def test_bidirectional_lstm_with_peepholes_sequence_lens_and_initial_state(tmp_path):
    # Batch entry 0 stops after one step: its later steps keep the state and output zeros, and
    # the reverse direction starts at its own last step.
    node = helper.make_node(
        "LSTM",
        ["X", "W", "R", "B", "lens", "h0", "c0", "P"],
        ["Y", "Y_h", "Y_c"],
        hidden_size=HIDDEN,
        direction="bidirectional",
    )
    extra = [
        helper.make_tensor_value_info("lens", TensorProto.INT32, (BATCH,)),
        helper.make_tensor_value_info("h0", TensorProto.FLOAT, (2, BATCH, HIDDEN)),
        helper.make_tensor_value_info("c0", TensorProto.FLOAT, (2, BATCH, HIDDEN)),
    ]
    rng = np.random.default_rng(2)
    feeds = {
        "X": _x(),
        "lens": np.array([1, SEQ], np.int32),
        "h0": rng.standard_normal((2, BATCH, HIDDEN)).astype(np.float32),
        "c0": rng.standard_normal((2, BATCH, HIDDEN)).astype(np.float32),
    }
    _check(_model(tmp_path, node, 4, 2, extra=extra), feeds)


def test_reverse_gru_with_linear_before_reset(tmp_path):
    node = helper.make_node(
        "GRU",
        ["X", "W", "R", "B"],
        ["Y", "Y_h"],
        hidden_size=HIDDEN,
        direction="reverse",
        linear_before_reset=1,
    )
    _check(_model(tmp_path, node, 3, 1), {"X": _x()})


def test_rnn_with_relu_and_clip(tmp_path):
    node = helper.make_node(
        "RNN",
        ["X", "W", "R", "B"],
        ["Y", "Y_h"],
        hidden_size=HIDDEN,
        activations=["Relu"],
        clip=1.5,
    )
    _check(_model(tmp_path, node, 1, 1), {"X": _x()})


def test_symbolic_sequence_length_is_refused_naming_op_and_node(tmp_path):
    node = helper.make_node("GRU", ["X", "W", "R"], ["Y"], hidden_size=HIDDEN, name="enc")
    path = _model(tmp_path, node, 3, 1, seq="time")
    with pytest.raises(BuildError, match=r"'GRU' at node 'enc'.*sequence length is symbolic"):
        ek.build(
            path, backend="tvm", shapes={"X": [(1, BATCH, IN), (2, BATCH, IN), (3, BATCH, IN)]}
        )
