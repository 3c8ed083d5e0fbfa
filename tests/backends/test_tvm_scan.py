"""ONNX Scan unrolled before TVM's import (enginekit/backends/tvm/scan.py): TVM 0.27's Relax
importer has no Scan converter."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")


def _scan_model(tmp_path, seq):
    """A running sum over axis 1 of ``x`` read in reverse, with a body initializer and a scan
    output stacked on axis 1 in reverse."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["sum"]),
            helper.make_node("Mul", ["sum", "half"], ["s_out"]),
            helper.make_node("Relu", ["sum"], ["y_t"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("s_in", f, (2,)),
            helper.make_tensor_value_info("x_t", f, (2,)),
        ],
        [
            helper.make_tensor_value_info("s_out", f, (2,)),
            helper.make_tensor_value_info("y_t", f, (2,)),
        ],
        [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half")],
    )
    node = helper.make_node(
        "Scan",
        ["s0", "x"],
        ["s", "y"],
        name="loop",
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[1],
        scan_input_directions=[1],
        scan_output_axes=[1],
        scan_output_directions=[1],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("s0", f, (2,)),
            helper.make_tensor_value_info("x", f, (2, seq)),
        ],
        [
            helper.make_tensor_value_info("s", f, (2,)),
            helper.make_tensor_value_info("y", f, (2, seq)),
        ],
    )
    path = tmp_path / "scan.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)]), path)
    return path


def test_scan_with_reversed_axes_is_unrolled(tmp_path):
    path = _scan_model(tmp_path, 4)
    rng = np.random.default_rng(0)
    feeds = {
        "s0": rng.standard_normal(2).astype(np.float32),
        "x": rng.standard_normal((2, 4)).astype(np.float32),
    }
    with ek.build(path, backend="tvm", shapes={"s0": [(2,)] * 3, "x": [(2, 4)] * 3}) as engine:
        got = engine.infer(feeds)
    for name, want in reference(path, feeds).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


def test_scan_of_unknown_length_is_refused_naming_the_node(tmp_path):
    path = _scan_model(tmp_path, "n")
    with pytest.raises(BuildError, match=r"op 'Scan'.*node 'loop'"):
        ek.build(path, backend="tvm", shapes={"s0": [(2,)] * 3, "x": [(2, 1), (2, 2), (2, 3)]})
