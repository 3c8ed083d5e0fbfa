"""enginekit's TVM MaxPool converter for the ``Indices`` output
(enginekit/backends/tvm/pool.py), which TVM 0.27's importer does not produce."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import matches_reference, save_graph
from onnx import TensorProto, helper

from enginekit.backends.tvm.pool import window_geometry

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def test_window_geometry_with_ceil_mode_drops_a_window_starting_in_the_padding():
    # 5 with kernel 2, stride 2, pads (1, 1): floor gives 3 windows, ceil 4, but the fourth
    # would start at 6 >= 5 + 1 (past the input), so ceil also gives 3.
    assert window_geometry(5, 2, 2, 1, (1, 1), False) == (3, 1, 0)
    assert window_geometry(5, 2, 2, 1, (1, 1), True) == (3, 1, 0)
    # 6 with kernel 3, stride 2, no pads: floor 2 windows, ceil 3 (reading 1 past the end).
    assert window_geometry(6, 3, 2, 1, (0, 0), True) == (3, 0, 1)


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 3], "strides": [2, 1], "ceil_mode": 1, "storage_order": 1},
        {"kernel_shape": [3, 2], "pads": [0, 1, 1, 0], "strides": [2, 2], "dilations": [2, 1]},
        {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"},
    ],
)
def test_max_pool_indices_match_onnx_runtime(tmp_path, attrs):
    # TVM: "Missing outputs during conversion. Expected 2 but Got 1 in MaxPool".
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    path = save_graph(tmp_path, [node], {"x": (F, (2, 3, 6, 7))}, {"y": F, "i": I64}, 12)
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 7)).astype(np.float32)
    x[0, 0, :2, :2] = 1.0  # ties: the first in row-major order wins
    matches_reference(path, {"x": x}, "tvm", rtol=0, atol=0)
