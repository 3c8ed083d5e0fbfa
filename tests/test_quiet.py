"""Quiet builds: no ONNX Runtime C++ log lines on stderr unless verbose (at the fd level)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto
from onnx import helper as h

import enginekit as ek
from enginekit.quiet import filter_native, native_stderr


def _bad_reshape():
    # Verification inputs no value of which runs: ONNX Runtime logs an [E:onnxruntime:...] line
    # for every failed run at its default severity.
    graph = h.make_graph(
        [h.make_node("Concat", ["n", "n"], ["s"], axis=0), h.make_node("Reshape", ["x", "s"], ["y"])],
        "bad_reshape",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [10]),
         h.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_failed_reference_runs_leave_no_onnxruntime_log_lines_on_stderr(capfd):
    with pytest.raises(ek.BuildError):
        ek.build(_bad_reshape())
    err = capfd.readouterr().err
    assert "onnxruntime:" not in err and "[E:" not in err


def test_verbose_lets_onnxruntime_log_lines_through(capfd):
    logger = logging.getLogger("enginekit")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.raises(ek.BuildError):
            ek.build(_bad_reshape())
    finally:
        logger.setLevel(old)
    assert "onnxruntime" in capfd.readouterr().err


def test_native_stderr_keeps_other_lines_and_drops_native_ones(capfd):
    import os

    with native_stderr("test"):
        os.write(2, b"2026-12-01 03:00:00.1 [E:onnxruntime:, x.cc:1 f] boom\n")
        os.write(2, b"[12:00:00] /src/relax/block_builder.cc:65: BlockBuilder destroyed\n")
        os.write(2, b"a warning of our own\n")
        print("Error converting operator Foo, with inputs: [x]")
        print("other output")
    captured = capfd.readouterr()
    assert captured.err == "a warning of our own\n"
    assert captured.out == "other output\n"
    assert filter_native("W0000 00:00:1.5  12 x.cc:9] absl\nkept\n", "t") == "kept\n"


def test_a_clean_build_writes_nothing_to_stderr(capfd):
    x = np.zeros((1, 4), np.float32)
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["y"])], "relu",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )  # fmt: skip
    engine = ek.build(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    engine.infer(x)
    engine.close()
    assert capfd.readouterr().err == ""


def test_a_failed_tvm_conversion_leaves_no_tvm_lines_on_stdout_or_stderr(capfd):
    pytest.importorskip("tvm")
    if not ek.backends.availability("tvm").available:
        pytest.skip("tvm backend not available here")
    # A Reshape whose shape is computed from the data (x's maximum): TVM's frontend print()s
    # "Error converting operator Reshape" and its BlockBuilder warns "destroyed with
    # remaining blocks" on stderr when the failed conversion is freed.
    nodes = [
        h.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        h.make_node("Cast", ["m"], ["mi"], to=TensorProto.INT64),
        h.make_node("Reshape", ["mi", "one"], ["m1"]),
        h.make_node("Concat", ["two", "m1"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    graph = h.make_graph(
        nodes, "data_shaped",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [h.make_tensor("one", TensorProto.INT64, [1], [1]),
         h.make_tensor("two", TensorProto.INT64, [1], [2])],
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    with pytest.raises(ek.BuildError, match="frontend failed"):
        ek.build(model, backend="tvm")
    captured = capfd.readouterr()
    for text in (captured.out, captured.err):
        assert "Error converting operator" not in text and "BlockBuilder" not in text
