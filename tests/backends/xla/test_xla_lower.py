"""The ONNX -> JAX lowering: checks before compiling, NHWC tracking, static shape arithmetic."""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")

import xla_graphs as graphs  # noqa: E402
from conftest import reference  # noqa: E402

import enginekit as ek  # noqa: E402
from enginekit.backends.xla import check, lower, program  # noqa: E402
from enginekit.errors import BuildError  # noqa: E402


def _run(lowered: lower.Lowered, *inputs: np.ndarray) -> list[np.ndarray]:
    with jax.enable_x64(True):
        return [np.asarray(o) for o in jax.jit(lowered.fn)(lowered.weights, inputs)]


def _stablehlo(lowered: lower.Lowered, *inputs: np.ndarray) -> str:
    with jax.enable_x64(True):
        return jax.jit(lowered.fn).lower(lowered.weights, inputs).as_text()


def test_unsupported_op_is_a_build_error_naming_op_and_node_before_compiling(tmp_path):
    path = tmp_path / "m.onnx"
    ek.Model.save(ek.load_model(graphs.with_node("NonZero", "find_nonzero")), path)
    with graphs.counting_compiles() as compiles:
        with pytest.raises(BuildError, match=r"find_nonzero.*NonZero|NonZero.*find_nonzero"):
            ek.build(path, backend="xla", shapes={"x": (2, 4)})
    assert compiles == []


def test_op_from_another_domain_is_refused_with_its_domain():
    m = graphs.with_node("Gelu", "ms_gelu", domain="com.microsoft")
    with pytest.raises(BuildError, match=r"ms_gelu.*com\.microsoft::Gelu"):
        check.check(m)


def test_every_unsupported_node_is_listed_at_once():
    m = graphs.with_node("NonZero", "first")
    m.graph.node.append(__import__("onnx").helper.make_node("Unique", ["y"], ["z"], name="second"))
    found = check.problems(m)
    assert any("first" in p and "NonZero" in p for p in found)
    assert any("second" in p and "Unique" in p for p in found)


def test_unsupported_attribute_value_names_the_node():
    m = graphs.cnn(20)
    bn = next(n for n in m.graph.node if n.op_type == "BatchNormalization")
    bn.name = "bn_per_activation"
    bn.attribute.append(__import__("onnx").helper.make_attribute("spatial", 0))
    lowered = lower.lower(m)
    with pytest.raises(BuildError, match=r"bn_per_activation.*spatial=0"):
        _run(lowered, np.zeros((1, 3, 8, 8), np.float32))


def test_shape_decided_at_run_time_is_a_build_error():
    lowered = lower.lower(graphs.reshape_by_input())
    with pytest.raises(BuildError, match=r"by_input.*Reshape's shape must be known"):
        _run(lowered, np.zeros((2, 6), np.float32), np.array([3, 4], np.int64))


def test_nhwc_and_nchw_lowerings_agree():
    m = graphs.conv_chain()
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (nhwc,) = _run(lower.lower(m, "nhwc"), x)
    (nchw,) = _run(lower.lower(m, "nchw"), x)
    np.testing.assert_allclose(nhwc, nchw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nhwc, reference_of(m, x), rtol=1e-4, atol=1e-4)


def reference_of(m, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_nhwc_transposes_once_at_each_edge_of_a_conv_chain():
    x = np.zeros((2, 3, 8, 8), np.float32)
    nhwc = lower.lower(graphs.conv_chain(), "nhwc")
    text = _stablehlo(nhwc, x)
    assert nhwc.stats["layout_conversions"] == 2
    assert len(re.findall(r"stablehlo\.transpose", text)) == 2
    # Kernels arrive pre-transposed to HWIO: the program never transposes a weight (the 1x1
    # skip kernel, 24 values, is inlined as a constant and transposed in numpy while tracing).
    assert nhwc.stats["pretransformed_weights"] == 2
    assert {w.shape for w in nhwc.weights} >= {(3, 3, 3, 8), (3, 3, 8, 8)}


def test_weights_are_arguments_not_program_constants():
    lowered = lower.lower(graphs.conv_chain(), "nhwc")
    text = _stablehlo(lowered, np.zeros((1, 3, 8, 8), np.float32))
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tensor<3x3x8x8xf32>" in main and "tensor<3x3x3x8xf32>" in main
    sizes = [
        int(np.prod([int(d) for d in dims.split("x")[:-1]] or [1]))
        for dims in re.findall(r"stablehlo\.constant dense<.*?> : tensor<([^>]*)>", text)
    ]
    assert max(sizes) <= lower.INLINE_LIMIT


@pytest.mark.slow
def test_opset9_and_opset20_versions_of_a_cnn_give_the_same_results(tmp_path):
    x = np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)
    outputs = []
    for opset in (9, 20):
        path = tmp_path / f"cnn{opset}.onnx"
        ek.Model.save(ek.load_model(graphs.cnn(opset)), path)
        engine = ek.build(
            path,
            backend="xla",
            shapes={"x": [(1, 3, 8, 8), (4, 3, 8, 8), (4, 3, 8, 8)]},
            xla_flags="xla-default",
        )
        outputs.append(engine.infer(x)["probs"])
        np.testing.assert_allclose(
            outputs[-1], reference(path, {"x": x})["probs"], atol=1e-5, rtol=1e-4
        )
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-6, rtol=1e-5)


def test_shape_arithmetic_stays_out_of_the_program():
    lowered = lower.lower(graphs.shape_chain())
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(lowered.fn)(lowered.weights, (np.zeros((2, 4, 6), np.float32),))
    assert {e.primitive.name for e in jaxpr.jaxpr.eqns} == {"reshape"}


def test_shape_arithmetic_with_a_symbolic_batch_exports_without_shape_ops():
    m = ek.load_model(graphs.shape_chain())
    lowered = lower.lower(m.proto)
    exported = program.export(lowered.fn, lowered.weights, m.inputs, {"x": ["batch", 4, 6]}, "cpu")
    assert str(exported.in_avals[-1].shape) == "(batch, 4, 6)"
    assert "stablehlo.gather" not in exported.mlir_module()  # no Shape -> Gather in the program
    compiled, _ = program.compile(exported, (), [(3, 4, 6)], [np.dtype(np.float32)], {})
    hlo = compiled.as_text()
    assert "gather(" not in hlo and "concatenate(" not in hlo


def test_dequantized_weights_fold_into_float_kernels_at_build_time():
    lowered = lower.lower(graphs.quantized_conv(), "nhwc")
    assert lowered.stats["folded_nodes"] == 1
    (kernel,) = lowered.weights
    assert kernel.dtype == np.float32 and kernel.shape == (3, 3, 3, 8)
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        _run(lowered, x)[0], reference_of(graphs.quantized_conv(), x), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_on_an_input_smaller_than_its_kernel_runs_as_a_matmul(layout, stride):
    """XLA swaps such a conv's operands into a form XLA:CPU runs ~30x slower (ResNet's last
    stage at small inputs); the lowering writes it as one matmul over the kernel windows."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(3).standard_normal((16, 8, 3, 3)).astype(np.float32)
    b = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    m = graphs.model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[stride] * 2)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    x = np.random.default_rng(5).standard_normal((3, 8, 2, 2)).astype(np.float32)
    lowered = lower.lower(m, layout)
    (got,) = _run(lowered, x)
    np.testing.assert_allclose(got, reference_of(m, x), rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        hlo = jax.jit(lowered.fn).lower(lowered.weights, (x,)).compile().as_text()
    assert "rhs_reversal" not in hlo
    assert " convolution(" not in hlo


def test_gemm_weight_is_stored_transposed_so_no_call_copies_it():
    """Gemm(transB=1) with a constant B: B is stored as [K, N], so XLA:CPU's dot does not copy
    it into that layout on every call."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(6).standard_normal((100, 64)).astype(np.float32)
    m = graphs.model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 100])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(100, np.float32), "b")],
    )
    x = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
    lowered = lower.lower(m)
    assert [a.shape for a in lowered.weights] == [(100,), (64, 100)]
    (got,) = _run(lowered, x)
    np.testing.assert_allclose(got, reference_of(m, x), rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        compiled = jax.jit(lowered.fn).lower(lowered.weights, (x,)).compile()
    assert program.hlo_summary(compiled)["transposes"] == 0
    assert "transpose_copy_fusion" not in compiled.as_text()
