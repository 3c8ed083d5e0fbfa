"""TVM backend on Resize as PyTorch exports ``F.interpolate(size=...)``: the sizes input is the
input's own (symbolic) batch and channels concatenated with constant H, W, the pattern of
torchvision's segmentation heads (FCN, DeepLabV3, LR-ASPP)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import reference
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def _resize_model(path: Path, mode: str) -> Path:
    nodes = [
        helper.make_node("Shape", ["x"], ["nc"], start=0, end=2),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node(
            "Resize",
            ["x", "", "", "sizes"],
            ["y"],
            mode=mode,
            coordinate_transformation_mode="half_pixel",
            nearest_mode="floor",
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 8, 7])],
        [numpy_helper.from_array(np.array([8, 7], np.int64), "hw")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resize_to_constant_size_with_a_symbolic_batch_builds_and_matches(tmp_path, mode):
    path = _resize_model(tmp_path / f"resize_{mode}.onnx", mode)
    with ek.build(
        path, backend="tvm", shapes={"x": [(1, 3, 4, 5), (2, 3, 4, 5), (4, 3, 4, 5)]}
    ) as engine:
        for batch in (1, 3):
            feed = {
                "x": np.random.default_rng(batch)
                .standard_normal((batch, 3, 4, 5))
                .astype(np.float32)
            }
            got = engine.infer(feed)
            ref = reference(path, feed)
            assert got["y"].shape == (batch, 3, 8, 7)
            np.testing.assert_allclose(got["y"], ref["y"], rtol=1e-5, atol=1e-5)
