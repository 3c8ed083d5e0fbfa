"""enginekit's TVM converter for 2-D DeformConv (enginekit/backends/tvm/deform.py); TVM 0.27's
Relax importer has none ("cannot convert op")."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import matches_reference
from onnx import TensorProto, helper

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F = TensorProto.FLOAT


def test_deform_conv_with_groups_mask_bias_strides_and_dilations(tmp_path):
    # Offsets up to +-2 pixels push taps past the border (zero there) and between pixels.
    node = helper.make_node(
        "DeformConv", ["x", "w", "offset", "b", "mask"], ["y"],
        group=2, offset_group=2, pads=[1, 2, 1, 0], strides=[2, 1], dilations=[1, 2],
    )  # fmt: skip
    # Output: rows (5 + 2 - 2) // 2 + 1 = 3, columns (6 + 2 - 3) // 1 + 1 = 6.
    shapes = {
        "x": (1, 4, 5, 6),
        "w": (6, 2, 2, 2),
        "offset": (1, 2 * 2 * 4, 3, 6),
        "b": (6,),
        "mask": (1, 2 * 4, 3, 6),
    }
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(k, F, v) for k, v in shapes.items()],
        [helper.make_tensor_value_info("y", F, None)],
    )
    path = tmp_path / "deform.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    feeds["offset"] = rng.uniform(-2, 2, shapes["offset"]).astype(np.float32)
    matches_reference(path, feeds, "tvm", rtol=1e-4, atol=1e-5)
