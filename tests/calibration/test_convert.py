"""fp16 / bf16 model conversion."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from calib_models import tiny_cnn
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from enginekit.calibration.convert import to_bf16, to_fp16


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32) * 0.3, "w2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bf16_computes_matmuls_in_bf16_keeps_io_and_softmax_fp32():
    src = _mlp()
    out = to_bf16(src)
    onnx.checker.check_model(out, full_check=True)
    types = {t.name: t.data_type for t in out.graph.initializer}
    assert types["w1"] == types["w2"] == TensorProto.BFLOAT16
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    softmax = next(n for n in out.graph.node if n.op_type == "Softmax")
    assert softmax.input[0].endswith("__to_fp32")  # cast back before the sensitive op
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    ref = ReferenceEvaluator(src).run(None, {"x": x})[0]
    got = ReferenceEvaluator(out).run(None, {"x": x})[0]
    assert got.dtype == np.float32 and np.abs(got - ref).max() < 2e-2


def test_bf16_leaves_convs_whose_schema_has_no_bf16_in_float32():
    out = to_bf16(tiny_cnn())
    onnx.checker.check_model(out, full_check=True)
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["Conv"] == 2 and ops["Cast"] <= 2  # only the final Gemm goes bf16


def test_fp16_model_runs_on_onnxruntime_cpu_close_to_float32():
    src = tiny_cnn()
    out = to_fp16(src)
    assert any(t.data_type == TensorProto.FLOAT16 for t in out.graph.initializer)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    x = np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32)
    runs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )[0]
        for m in (src, out)
    ]
    assert np.abs(runs[0] - runs[1]).max() < 1e-2
