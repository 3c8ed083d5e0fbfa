"""Q/DQ placement of the onnxruntime-cpu style (enginekit/calibration/writers.py): in a
transformer only the weighted ops are quantized (the attention-mask Add is what broke BERT),
graph outputs stay float, and keep_float (enginekit/calibration/fallback.py) gives a layer its
float inputs back exactly, also where ONNX Runtime's quantizer removed a Relu."""

from __future__ import annotations

import calib_models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.calibration.fallback import keep_float, quantized_nodes
from enginekit.calibration.writers import write_qdq

SEQ, DIM, CLASSES = 8, 16, 5


def attention() -> onnx.ModelProto:
    """One attention head with a padding mask the way exporters write it:
    ``scores + (1 - mask) * finfo.min``, then Softmax, then pooling and a classifier."""
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    def c(name: str, value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(value, np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Mul", ["s", "scale"], ["s2"], name="scale"),
        helper.make_node("Sub", ["one", "mask"], ["inv"], name="inv"),
        helper.make_node("Mul", ["inv", "lowest"], ["bias"], name="bias"),
        helper.make_node("Unsqueeze", ["bias", "axis1"], ["bias3"], name="bias3"),
        helper.make_node("Add", ["s2", "bias3"], ["masked"], name="mask_add"),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["ctx"], name="ctx"),
        helper.make_node("ReduceMean", ["ctx", "axis1"], ["pooled"], keepdims=0, name="pool"),
        helper.make_node("Gemm", ["pooled", "wc"], ["logits"], name="classifier"),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, DIM]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", SEQ]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [
            w("wq", DIM, DIM), w("wk", DIM, DIM), w("wv", DIM, DIM), w("wc", DIM, CLASSES),
            c("scale", 0.25), c("one", 1.0), c("lowest", float(np.finfo(np.float32).min)),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        ],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _feeds(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((n, SEQ), np.float32)
    for i, length in enumerate(rng.integers(3, SEQ + 1, n)):
        mask[i, length:] = 0.0  # padded positions
    return {"x": rng.standard_normal((n, SEQ, DIM)).astype(np.float32), "mask": mask}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def attention_table() -> ek.CalibrationTable:
    return ek.calibrate(attention(), _feeds(128, 1), method="minmax", batch_size=32)


def test_transformer_quantizes_weighted_ops_only_and_keeps_the_mask_add_float(attention_table):
    model, feeds = attention(), _feeds(64, 2)
    qdq = write_qdq(model, attention_table, style="onnxruntime-cpu")
    maker = {o: n.op_type for n in qdq.graph.node for o in n.output}
    for node in qdq.graph.node:
        if node.name in ("mask_add", "softmax", "bias", "inv"):
            assert all(maker.get(i) != "DequantizeLinear" for i in node.input), node.name
    q = next(n for n in qdq.graph.node if n.name == "q")
    assert maker[q.input[1]] == "DequantizeLinear"  # the weighted ops are int8
    assert _cosine(_run(qdq, feeds), _run(model, feeds)) > 0.99


def test_quantizing_the_mask_add_is_what_breaks_attention(attention_table):
    """The cause, kept as a test: with the elementwise ops and Softmax quantized (what the
    writer did before), the mask's ~1e38 range rounds every score to one level."""
    model, feeds = attention(), _feeds(64, 2)
    every = ["MatMul", "Gemm", "Add", "Mul", "Sub", "Softmax"]
    qdq = write_qdq(model, attention_table, style="onnxruntime-cpu", op_types=every)
    assert _cosine(_run(qdq, feeds), _run(model, feeds)) < 0.9


def test_graph_outputs_stay_float(tiny_cnn_path, tiny_table):
    qdq = write_qdq(tiny_cnn_path, tiny_table, style="onnxruntime-cpu")
    maker = {o: n.op_type for n in qdq.graph.node for o in n.output}
    assert maker["logits"] == "Gemm"


def test_keep_float_of_every_layer_gives_the_float_model_back(tiny_cnn_path, tiny_table, calib_x):
    source = onnx.load(str(tiny_cnn_path))
    qdq = write_qdq(source, tiny_table, style="onnxruntime-cpu")
    # ONNX Runtime's quantizer drops the Relus (the Q after each conv clips at zero) ...
    assert not any(n.op_type == "Relu" for n in qdq.graph.node)
    layers = quantized_nodes(qdq)
    assert {"conv1", "conv2", "fc"} <= set(layers)
    back = keep_float(qdq, source, layers)
    # ... and keep_float puts them back for the float readers: exactly the float model.
    np.testing.assert_allclose(
        _run(back, {"x": calib_x}), _run(source, {"x": calib_x}), rtol=1e-5, atol=1e-5
    )
    onnx.checker.check_model(back)


def test_keep_float_refuses_a_layer_of_neither_model(tiny_cnn_path, tiny_table):
    source = onnx.load(str(tiny_cnn_path))
    qdq = write_qdq(source, tiny_table, style="onnxruntime-cpu")
    with pytest.raises(ek.CalibrationError, match="conv9 are not nodes of both"):
        keep_float(qdq, source, ["conv9"])


# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table
