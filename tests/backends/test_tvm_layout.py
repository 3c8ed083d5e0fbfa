"""TVM backend layout: NHWC is a speed option that never costs a build, and the manifest says
which convolutions run in which layout and why."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import reference
from models import CASES
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek

tvm = pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

CNN = CASES["cnn"]
SMALL = {"x": [(1, 3, 8, 8), (2, 3, 8, 8), (2, 3, 8, 8)]}


def _save(path, nodes, inits, x_shape, y_shape, opset=18):
    """Writes a one-input (``x``), one-output (``y``) model of ``nodes`` and returns its path."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *y_shape])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if opset < 11:
        model.ir_version = 7
    onnx.save(model, path)
    return path


def test_a_failing_nhwc_conversion_builds_nchw_and_records_why(onnx_model, monkeypatch):
    # Fault injection: TVM's ConvertLayout has died with InternalErrors on real models; the
    # build must then go on in the model's own layout instead of failing.
    from tvm import relax

    def broken(_desired):
        raise tvm.error.InternalError("Check failed: (layout.defined()) is false: injected")

    monkeypatch.setattr(relax.transform, "ConvertLayout", broken)
    path = onnx_model("cnn")
    with ek.build(path, backend="tvm", shapes=CNN.shapes) as engine:
        meta = engine.manifest["backend"]["metadata"]
        assert meta["layout"] == "NCHW"
        assert set(meta["conv_layouts"]) == {"NCHW/OIHW"}
        assert any("NHWC failed" in n and "injected" in n for n in meta["layout_notes"])
        feeds = CNN.feeds(3, seed=1)
        np.testing.assert_allclose(
            engine.infer(feeds)["output"], reference(path, feeds)["output"], atol=1e-4, rtol=1e-3
        )


def test_convs_convertlayout_skips_are_named_in_the_manifest(tmp_path):
    # conv1d then conv2d: the conv2d runs NHWC, the conv1d stays NCW and the manifest says why.
    rng = np.random.default_rng(0)
    inits = {
        "w1": rng.standard_normal((3, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "flat": np.array([0, 3, 64], np.int64),
        "square": np.array([0, 3, 8, 8], np.int64),
    }
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["r"]),
        helper.make_node("Conv", ["r", "w1"], ["c1"], pads=[1, 1]),
        helper.make_node("Reshape", ["c1", "square"], ["r2"]),
        helper.make_node("Conv", ["r2", "w2"], ["y"]),
    ]
    path = _save(tmp_path / "conv1d2d.onnx", nodes, inits, (3, 8, 8), (4, 6, 6))
    with ek.build(path, backend="tvm", shapes=SMALL) as e:
        meta = e.manifest["backend"]["metadata"]
        assert meta["layout"] == "NHWC"
        assert meta["conv_layouts"] == {"NCW/OIW": 1, "NHWC/HWIO": 1}
        assert meta["layout_notes"] == [
            "1 conv1d kept in NCW: TVM's ConvertLayout converts conv2d only"
        ]


@pytest.mark.parametrize("opset", [9, 18])
def test_nhwc_passes_through_clip_without_transposes(tmp_path, opset):
    # conv -> ReLU6 (Clip) -> conv, as in MobileNets: TVM 0.27 imports Clip as an opaque TIR
    # call, which left a transpose on each side of every clip.
    rng = np.random.default_rng(3)
    inits = {
        "w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
    }
    if opset >= 11:
        inits |= {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
        clip = helper.make_node("Clip", ["c1", "lo", "hi"], ["r"])
    else:
        clip = helper.make_node("Clip", ["c1"], ["r"], min=0.0, max=6.0)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        clip,
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    path = _save(tmp_path / "relu6.onnx", nodes, inits, (3, 8, 8), (4, 8, 8), opset)
    with ek.build(path, backend="tvm", shapes=SMALL) as e:
        meta = e.manifest["backend"]["metadata"]
        assert meta["conv_layouts"] == {"NHWC/HWIO": 2}
        assert meta["transposes"] == 2  # the input in, the output out
        x = {"x": 4 * rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
        np.testing.assert_allclose(e.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-4)


def test_nhwc_relays_per_channel_constants_of_lower_rank(tmp_path):
    # conv -> concat -> x * s with s of shape (C, 1, 1) -> relu -> conv: batch norm left after
    # a concat (DenseNet) exports that way; ConvertLayout used to transpose back around it.
    rng = np.random.default_rng(4)
    inits = {
        "w0": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "w1": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
        "s": rng.standard_normal((8, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w1"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        helper.make_node("Mul", ["c", "s"], ["cs"]),
        helper.make_node("Relu", ["cs"], ["cr"]),
        helper.make_node("Conv", ["cr", "w2"], ["y"]),
    ]
    path = _save(tmp_path / "concat_scale.onnx", nodes, inits, (3, 8, 8), (4, 8, 8))
    with ek.build(path, backend="tvm", shapes=SMALL) as e:
        assert e.manifest["backend"]["metadata"]["transposes"] == 2
        x = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
        np.testing.assert_allclose(e.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-3)


def _squeeze_model(tmp_path):
    """conv (W 3 -> 1) -> relu -> Squeeze(-1) -> Unsqueeze(-1) -> 1x1 conv, as
    ``x.squeeze(-1)`` between convolutions exports."""
    rng = np.random.default_rng(5)
    inits = {
        "w1": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((5, 4, 1, 1)).astype(np.float32),
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 0, 1, 0]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Squeeze", ["r", "axes"], ["s"]),
        helper.make_node("Unsqueeze", ["s", "axes"], ["u"]),
        helper.make_node("Conv", ["u", "w2"], ["y"]),
    ]
    path = _save(tmp_path / "squeeze.onnx", nodes, inits, (3, 8, 3), (5, 8, 1))
    return path


SQUEEZE_SHAPES = {"x": [(1, 3, 8, 3), (2, 3, 8, 3), (2, 3, 8, 3)]}


def test_squeeze_with_a_negative_axis_keeps_the_model_nhwc(tmp_path):
    # TVM 0.27's ConvertLayout died with std::bad_alloc on squeeze(axis=-1) and the whole
    # model fell back to NCHW; the axis is made non-negative first.
    path = _squeeze_model(tmp_path)
    with ek.build(path, backend="tvm", shapes=SQUEEZE_SHAPES) as e:
        meta = e.manifest["backend"]["metadata"]
        assert meta["layout"] == "NHWC", meta["layout_notes"]
        assert meta["conv_layouts"] == {"NHWC/HWIO": 2}
        assert meta["layout_barriers"] == [] and meta["layout_notes"] == []
        x = {"x": np.random.default_rng(6).standard_normal((2, 3, 8, 3)).astype(np.float32)}
        np.testing.assert_allclose(e.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-4)


def test_an_op_convertlayout_fails_on_is_kept_nchw_alone(tmp_path, monkeypatch):
    # Without the axis fix, TVM's failure on the squeeze is real: bisecting finds it, the
    # squeeze runs NCHW behind transposes and both convolutions still run NHWC.
    from enginekit.backends.tvm import layout

    monkeypatch.setattr(layout, "positive_axes", lambda mod: mod)
    from enginekit.artifact import open_artifact
    from enginekit.backends import tvm as tvm_backend

    path = _squeeze_model(tmp_path)
    out = tmp_path / "squeeze.ekit"
    with ek.build(path, backend="tvm", shapes=SQUEEZE_SHAPES, output=out) as e:
        meta = e.manifest["backend"]["metadata"]
        assert meta["layout"] == "NHWC" and meta["conv_layouts"] == {"NHWC/HWIO": 2}
        [barrier] = meta["layout_barriers"]
        assert barrier["op"] == "relax.squeeze" and "bad_alloc" in barrier["why"]
        assert barrier["var"].endswith("(batch, 4, 8)")
        assert tvm_backend.inspect(open_artifact(out))["layout_barriers"] == [barrier]
        x = {"x": np.random.default_rng(7).standard_normal((2, 3, 8, 3)).astype(np.float32)}
        np.testing.assert_allclose(e.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-4)


def test_nhwc_passes_through_hardswish_and_hardsigmoid_without_transposes(tmp_path):
    # MobileNetV3's activations: TVM 0.27 converts both with an opaque clip, which put a
    # transpose on each side of every one (65 in torchvision's mobilenet_v3_small).
    rng = np.random.default_rng(8)
    inits = {
        "w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["h"]),
        helper.make_node("HardSigmoid", ["h"], ["g"], alpha=0.25),
        helper.make_node("Mul", ["h", "g"], ["m"]),
        helper.make_node("Conv", ["m", "w2"], ["y"]),
    ]
    path = _save(tmp_path / "hardswish.onnx", nodes, inits, (3, 8, 8), (4, 8, 8))
    with ek.build(path, backend="tvm", shapes=SMALL) as e:
        meta = e.manifest["backend"]["metadata"]
        assert meta["conv_layouts"] == {"NHWC/HWIO": 2}
        assert meta["transposes"] == 2
        x = {"x": 2 * rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
        np.testing.assert_allclose(e.infer(x)["y"], reference(path, x)["y"], rtol=1e-4, atol=1e-4)
