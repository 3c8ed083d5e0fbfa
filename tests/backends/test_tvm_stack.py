"""Register tiles stay stack arrays (enginekit/backends/tvm/stack.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm_conv_case import conv_relu_reference, fused_conv_relu

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

WORKSPACE = "TVMBackendAllocWorkspace"


def _tile_kernel(floats: int):
    """A parallel loop whose body fills a ``local`` buffer of ``floats`` and writes it back."""
    from tvm.script import tirx as T

    @T.prim_func
    def tile(a: T.Buffer((64, floats), "float32"), b: T.Buffer((64, floats), "float32")):
        for i in T.parallel(64):
            acc = T.alloc_buffer((floats,), "float32", scope="local")
            for j in range(floats):
                acc[j] = a[i, j] * T.float32(2)
            for j in range(floats):
                b[i, j] = acc[j] + T.float32(1)

    return tile


@pytest.mark.parametrize(("floats", "on_stack"), [(256, True), (512, True), (1024, False)])
def test_a_local_buffer_of_up_to_2_kib_is_a_stack_array_and_larger_ones_use_the_workspace(
    floats, on_stack
):
    # 256 floats is AVX-512's 8 x 32 register tile: exactly TVM's 1 KiB stack limit, so it
    # was allocated from the workspace pool once per parallel iteration.
    import tvm

    from enginekit.backends.tvm import lower

    target = lower.resolve_target(None, "cpu")
    ex = lower.compile_module(tvm.IRModule({"main": _tile_kernel(floats)}), target)
    assert (WORKSPACE not in ex.mod.inspect_source("ll")) == on_stack
    a = np.random.default_rng(0).standard_normal((64, floats)).astype("float32")
    b = tvm.runtime.tensor(np.zeros_like(a))
    ex.mod["main"](tvm.runtime.tensor(a), b)
    np.testing.assert_allclose(b.numpy(), a * 2 + 1, rtol=1e-6)


def test_a_3x3_conv_over_a_symbolic_batch_allocates_no_workspace_and_matches_numpy():
    # The demo CNN's 32 -> 32 3x3 conv: on AVX-512 its tile is 8 pixels x 32 channels (1 KiB);
    # from the workspace pool it ran at 56 GF/s alone, on the stack at ~200 (one thread).
    import tvm
    from tvm import relax, tirx

    from enginekit.backends.tvm import lower

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 3, 32, 32)) * 0.1).astype("float32")
    x = relax.Var("x", relax.TensorType((tirx.Var("batch", "int64"), 16, 16, 32), "float32"))
    fused, target = fused_conv_relu(x, w)
    scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    ex = lower.compile_module(scheduled, target)
    assert WORKSPACE not in ex.mod.imports[0].inspect_source("ll")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for batch in (1, 3):
        data = rng.standard_normal((batch, 16, 16, 32)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data)).numpy()
        np.testing.assert_allclose(got, conv_relu_reference(data, w), rtol=1e-4, atol=1e-4)


def test_a_residual_block_built_with_stack_tiles_matches_onnx_runtime(tmp_path):
    # The model path end to end: conv + ReLU, conv + residual add + ReLU, NHWC, symbolic batch.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import enginekit as ek

    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array((rng.standard_normal((32, 32, 3, 3)) * 0.1).astype("f4"), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((32, 32, 3, 3)) * 0.1).astype("f4"), "w2")
    pads = {"pads": [1, 1, 1, 1]}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c1"], **pads),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "w2"], ["c2"], **pads),
            helper.make_node("Add", ["c2", "x"], ["s"]),
            helper.make_node("Relu", ["s"], ["y"]),
        ],
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32, 16, 16])],
        [w1, w2],
    )
    path = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    shapes = {"x": [(1, 32, 16, 16), (4, 32, 16, 16), (4, 32, 16, 16)]}
    tvm_engine = ek.build(path, backend="tvm", shapes=shapes, layout="NHWC")
    ort_engine = ek.build(path, backend="onnxruntime", shapes=shapes)
    for batch in (1, 4):
        x = rng.standard_normal((batch, 32, 16, 16)).astype("float32")
        want = ort_engine.infer(x)["y"]
        np.testing.assert_allclose(tvm_engine.infer(x)["y"], want, rtol=1e-4, atol=1e-4)
    tvm_engine.close()
    ort_engine.close()
