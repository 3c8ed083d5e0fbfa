"""Convolutions XLA:CPU runs better as matmuls: 1x1 convolutions (a dot over the channels) and
convolutions on inputs smaller than their kernel (one dot over the windows), with no per-call
copy of the kernel in the optimized HLO."""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")

import xla_graphs as graphs  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from enginekit.backends.xla import lower, program  # noqa: E402


def _conv_model(cin: int, cout: int, k: int, size: int, **attrs):
    rng = np.random.default_rng(k * 10 + size)
    w = rng.standard_normal((cout, cin, k, k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    return graphs.model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", cin, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )


def _compiled(m, x: np.ndarray, layout: str = "nhwc"):
    lowered = lower.lower(m, layout)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(lowered.fn)(lowered.weights, (x,))[0])
        compiled = jax.jit(lowered.fn).lower(lowered.weights, (x,)).compile()
    return got, compiled


def _reference(m, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("stride", [1, 2])
def test_pointwise_conv_is_a_dot_over_channels(stride):
    m = _conv_model(16, 24, 1, 6, strides=[stride] * 2)
    x = np.random.default_rng(1).standard_normal((2, 16, 6, 6)).astype(np.float32)
    got, compiled = _compiled(m, x)
    np.testing.assert_allclose(got, _reference(m, x), rtol=1e-5, atol=1e-5)
    summary = program.hlo_summary(compiled)
    assert summary["convolutions"] == 0
    assert summary["transposes"] <= 2  # the input's and the output's layout change only


def test_small_input_conv_flattens_its_kernel_without_a_copy():
    """The windows sit side by side on the channel axis in the kernel's (taps, Cin) order, so
    the HWIO kernel is a [taps * Cin, Cout] matrix as it is stored (stacked on a new axis,
    XLA transposed the whole kernel on every call: 28 MB per ResNet-18 inference)."""
    m = _conv_model(8, 16, 3, 2, pads=[1, 1, 1, 1])
    x = np.random.default_rng(2).standard_normal((3, 8, 2, 2)).astype(np.float32)
    got, compiled = _compiled(m, x)
    np.testing.assert_allclose(got, _reference(m, x), rtol=1e-5, atol=1e-5)
    text = compiled.as_text()
    assert "f32[8,9,16]" not in text  # the kernel, channel-major: a copy
    assert program.hlo_summary(compiled)["convolutions"] == 0
    moved = re.findall(r"= (f32\[[\d,]*\])\S* transpose\(", text)
    assert moved and all(shape.startswith("f32[3,") for shape in moved)  # activations only
