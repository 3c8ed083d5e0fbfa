"""TVM backend on Resize as PyTorch exports ``F.interpolate(size=...)``: the sizes input is the
input's own (symbolic) batch and channels concatenated with constant H, W, the pattern of
torchvision's segmentation heads (FCN, DeepLabV3, LR-ASPP)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import matches_reference, reference
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


def _const(name, values, dtype=np.float32):
    return numpy_helper.from_array(np.array(values, dtype), name)


def test_resize_variants_the_importer_gets_wrong_match_the_reference(tmp_path):
    # TVM 0.27 ignored axes, antialias and keep_aspect_ratio_policy (an IndexError or wrong
    # sizes), refused half_pixel_symmetric, derived the transform from out/in instead of a
    # fractional scale, and cropped tf_crop_and_resize's roi wrongly: one node of each.
    resize = "Resize"
    nodes = [
        helper.make_node(
            resize, ["x", "", "", "sizes_hw"], ["axes_kept"], mode="nearest",
            axes=[3, 2], keep_aspect_ratio_policy="not_larger",
        ),
        helper.make_node(
            resize, ["x", "", "down"], ["cubic"], mode="cubic", antialias=1,
            cubic_coeff_a=-0.5, exclude_outside=1,
        ),
        helper.make_node(
            resize, ["x", "", "up"], ["symmetric"], mode="linear",
            coordinate_transformation_mode="half_pixel_symmetric",
        ),
        helper.make_node(
            resize, ["x", "roi", "", "sizes"], ["crop"], mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=7.0,
        ),
    ]  # fmt: skip
    init = [
        _const("sizes_hw", [7, 9], np.int64),
        _const("down", [1, 1, 0.6, 0.8]),
        _const("up", [1, 1, 1.7, 2.5]),
        _const("roi", [0, 0, -0.2, 0.4, 1, 1, 0.9, 1.3]),
        _const("sizes", [1, 2, 3, 4], np.int64),
    ]
    outputs = ["axes_kept", "cubic", "symmetric", "crop"]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 6])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        init,
    )
    path = tmp_path / "variants.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 6)).astype(np.float32)
    matches_reference(path, {"x": x}, "tvm", rtol=1e-4, atol=1e-5)


def test_resize_scales_from_a_graph_input_build_and_follow_the_values(tmp_path):
    # The build's generated example scales are random floats, which no Resize accepts: the
    # import failed at build ("index 0 is out of bounds") before verification could ask for
    # verify_data. Scales from an input reach only axes 2, 3 here.
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear", axes=[2, 3])
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 4]),
            helper.make_tensor_value_info("scales", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "scales.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    x = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    feeds = {"x": x, "scales": np.array([2.0, 1.5], np.float32)}
    shapes = {"x": [(1, 1, 3, 4)] * 3, "scales": [(2,)] * 3}
    with ek.build(path, backend="tvm", shapes=shapes, verify_data=feeds) as engine:
        got = engine.infer(feeds)["y"]
    np.testing.assert_allclose(got, reference(path, feeds)["y"], rtol=1e-5, atol=1e-6)
