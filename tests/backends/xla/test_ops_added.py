"""The ops added for ONNX test-data coverage, each against a few of its ONNX node test cases.

Attention, RotaryEmbedding, the losses, GridSample/AffineGrid/DeformConv, RNN/GRU/LSTM,
CausalConvWithState/LinearAttention, Scan/Loop and the smaller ops of ``ops/misc.py``: a handful
of cases per op lowered and run in one XLA program (``test_xla_ops.run_suite``), one Scan case
through ``ek.build`` and ``ek.load``, and the refusals: what the backend cannot take is a
BuildError naming the op and the node, raised before anything is compiled.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402
from test_xla_ops import Case, _array, _bake, run_suite  # noqa: E402

import enginekit as ek  # noqa: E402
from enginekit.backends.xla import lower  # noqa: E402
from enginekit.backends.xla.ops import supported_ops  # noqa: E402
from enginekit.errors import BuildError  # noqa: E402

#: op -> node test cases run here (a few per op: the variants its attributes select).
PICKED = {
    "Attention": [
        "test_attention_3d_gqa",
        "test_attention_4d_attn_mask_bool",
        "test_attention_4d_gqa_with_past_and_present",
        "test_attention_4d_with_qk_matmul_softcap",
        "test_attention_4d_causal",
    ],
    "RotaryEmbedding": ["test_rotary_embedding_3d_input", "test_rotary_embedding_interleaved"],
    "NegativeLogLikelihoodLoss": [
        "test_nllloss_NCd1d2_with_weight_reduction_mean",
        "test_nllloss_NCd1_mean_weight_negative_ii",
    ],
    "SoftmaxCrossEntropyLoss": ["test_sce_mean_weight_ii_3d_log_prob", "test_sce_sum"],
    "GridSample": [
        "test_gridsample_bicubic",
        "test_gridsample_reflection_padding",
        "test_gridsample_volumetric_bilinear_align_corners_0",
    ],
    "AffineGrid": ["test_affine_grid_2d", "test_affine_grid_3d_align_corners"],
    "DeformConv": ["test_deform_conv_with_multiple_offset_groups"],
    "RNN": ["test_simple_rnn_bidirectional", "test_rnn_seq_length"],
    "GRU": ["test_gru_reverse", "test_gru_batchwise"],
    "LSTM": ["test_lstm_with_peepholes", "test_lstm_bidirectional"],
    "CausalConvWithState": ["test_causal_conv_with_state_silu_with_past_state"],
    "LinearAttention": [
        "test_linear_attention_gated_delta_gqa",
        "test_linear_attention_prefill_with_past",
    ],
    "Scan": ["test_scan_sum", "test_scan9_multi_state"],
    "Loop": ["test_loop11"],
    "BitCast": ["test_bitcast_float32_to_int32", "test_bitcast_bool_to_uint8"],
    "CenterCropPad": ["test_center_crop_pad_crop_and_pad"],
    "Col2Im": ["test_col2im_pads", "test_col2im_5d"],
    "MaxUnpool": ["test_maxunpool_export_with_output_shape"],
    "TensorScatter": ["test_tensorscatter_circular"],
    "Det": ["test_det_nd"],
    "MatMulInteger": ["test_matmulinteger"],
    "QLinearMatMul": ["test_qlinearmatmul_3D_int8_float32"],
    "Compress": ["test_compress_negative_axis"],
    "BatchNormalization": ["test_batchnorm_epsilon_training_mode"],
    "TfIdfVectorizer": ["test_tfidfvectorizer_tf_batch_uniandbigrams_skip5"],
}


def _node_cases(names: set[str]) -> list[Case]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = node.collect_testcases(None)
    return [
        Case("node", c.name, c.model, c.data_sets, c.rtol, c.atol) for c in found if c.name in names
    ]


def test_every_added_op_is_in_the_op_table():
    assert set(PICKED) <= set(supported_ops())


def test_added_ops_pass_their_onnx_node_cases():
    wanted = {name for names in PICKED.values() for name in names}
    cases = _node_cases(wanted)
    assert {c.name for c in cases} == wanted
    report = run_suite(cases)
    assert report.failed == {}, report.failed
    assert sorted(report.passed) == sorted(wanted)


def test_scan_builds_loads_and_matches(tmp_path):
    (case,) = _node_cases({"test_scan9_sum"})
    inputs, outputs = case.data[0]
    model, runtime = _bake(case.model, list(inputs))
    onnx.save(model, str(tmp_path / "scan.onnx"))
    ek.build(
        tmp_path / "scan.onnx",
        backend="xla",
        output=tmp_path / "engine/",
        verify=False,
        xla_flags="xla-default",
    )
    with ek.load(tmp_path / "engine") as engine:
        got = engine.infer(runtime)
    for spec, want in zip(engine.outputs, outputs):
        np.testing.assert_allclose(got[spec.name], _array(want), rtol=1e-6)


def test_training_mode_batch_norm_channels_last_matches_channels_first():
    from enginekit.backends.xla.ops import nn

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    params = [rng.uniform(0.5, 1.5, size=3).astype(np.float32) for _ in range(4)]
    first = nn.BatchNormalization(x, *params, training_mode=1)
    last = nn.BatchNormalization(
        np.moveaxis(x, 1, -1), *params, training_mode=1, channels_last=True
    )
    np.testing.assert_allclose(np.moveaxis(np.asarray(last[0]), -1, 1), first[0], rtol=1e-5)
    for a, b in zip(first[1:], last[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _model(nodes, inputs, outputs, opset=20):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.mark.parametrize("op", ["NonZero", "Unique", "NonMaxSuppression"])
def test_data_dependent_output_shape_is_refused_before_compiling(op):
    inputs = ["x"] if op in ("NonZero", "Unique") else ["x", "x"]
    node = helper.make_node(op, inputs, ["y"], name="the_node")
    model = _model([node], [_float("x", [2, 3])], [_float("y", None)])
    with pytest.raises(BuildError, match=f"the_node \\({op}\\).*op {op} is not supported"):
        lower.lower(model)


def test_compress_with_a_run_time_condition_names_the_node():
    node = helper.make_node("Compress", ["x", "keep"], ["y"], name="the_node", axis=0)
    keep = helper.make_tensor_value_info("keep", TensorProto.BOOL, [2])
    model = _model([node], [_float("x", [2, 3]), keep], [_float("y", None)])
    low = lower.lower(model)
    with pytest.raises(BuildError, match="the_node \\(Compress\\).*condition is computed"):
        jax.eval_shape(low.fn, low.weights, (np.zeros((2, 3), np.float32), np.ones(2, bool)))


def test_loop_with_a_run_time_trip_count_names_the_node():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["v_in", "v_in"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            _float("v_in", [2]),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _float("v_out", [2])],
    )
    loop = helper.make_node("Loop", ["n", "", "v"], ["out"], name="the_loop", body=body)
    model = _model(
        [loop],
        [helper.make_tensor_value_info("n", TensorProto.INT64, []), _float("v", [2])],
        [_float("out", [2])],
    )
    low = lower.lower(model)
    with pytest.raises(BuildError, match="the_loop \\(Loop\\).*trip count is computed at run time"):
        jax.eval_shape(low.fn, low.weights, (np.zeros((), np.int64), np.zeros((2,), np.float32)))


def test_scan_body_with_an_opset_dependent_op_names_the_body_node():
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Softmax", ["s_out"], ["y_t"], name="inner_softmax"),
        ],
        "body",
        [_float("s_in", [3]), _float("x_t", [3])],
        [_float("s_out", [3]), _float("y_t", [3])],
    )
    scan = helper.make_node(
        "Scan", ["s", "xs"], ["s_final", "ys"], name="the_scan", body=body, num_scan_inputs=1
    )
    model = _model(
        [scan],
        [_float("s", [3]), _float("xs", [4, 3])],
        [_float("s_final", [3]), _float("ys", [4, 3])],
    )
    low = lower.lower(model)
    with pytest.raises(BuildError, match="the_scan \\(Scan\\).*inner_softmax \\(Softmax\\)"):
        jax.eval_shape(
            low.fn, low.weights, (np.zeros((3,), np.float32), np.zeros((4, 3), np.float32))
        )
