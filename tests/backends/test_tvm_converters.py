"""enginekit's own TVM converters (enginekit/backends/tvm/converters.py) for ops TVM 0.27's
Relax importer lacks or gets wrong, and the ops refused before import."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import matches_reference, reference, save_graph
from onnx import TensorProto, helper

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")

F = TensorProto.FLOAT


def _check(path, feeds):
    matches_reference(path, feeds, "tvm", rtol=1e-5, atol=1e-7)


def test_mish_keeps_tiny_values(tmp_path):
    # log(1 + e^x) is 0 in float32 for x < -17: mish was 0 instead of ~x e^x.
    path = save_graph(
        tmp_path, [helper.make_node("Mish", ["x"], ["y"])], {"x": (F, (4,))}, {"y": F}, 18
    )
    _check(path, {"x": np.array([-30.0, -18.0, 0.5, 3.0], np.float32)})


def test_cumprod_lp_normalization_and_reverse_sequence_convert(tmp_path):
    # None of the three has a converter in TVM 0.27 ("cannot convert op").
    axis = onnx.numpy_helper.from_array(np.array(1, np.int64), "axis")
    nodes = [
        helper.make_node("CumProd", ["x", "axis"], ["c"], exclusive=1, reverse=1),
        helper.make_node("LpNormalization", ["x"], ["n"], axis=0, p=1),
        helper.make_node("ReverseSequence", ["x", "lens"], ["r"], batch_axis=0, time_axis=1),
    ]
    inputs = {"x": (F, (2, 3)), "lens": (TensorProto.INT64, (2,))}
    path = save_graph(tmp_path, nodes, inputs, {"c": F, "n": F, "r": F}, 26, [axis])
    x = np.array([[1.0, -2.0, 3.0], [0.0, 0.5, 4.0]], np.float32)
    _check(path, {"x": x, "lens": np.array([3, 2], np.int64)})


def test_non_max_suppression_is_refused_before_compiling(tmp_path):
    # Its output's length depends on the scores; TVM failed deep in compilation (flat_map_).
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"], name="nms")
    inputs = {"boxes": (F, (1, 4, 4)), "scores": (F, (1, 1, 4))}
    path = save_graph(tmp_path, [node], inputs, {"sel": TensorProto.INT64}, 11)
    with pytest.raises(BuildError, match=r"op 'NonMaxSuppression' at node 'nms'.*depends on"):
        ek.build(path, backend="tvm", shapes={"boxes": [(1, 4, 4)] * 3, "scores": [(1, 1, 4)] * 3})


def test_reduce_max_of_all_minus_infinity_is_minus_infinity(tmp_path):
    # TVM starts max at float32's lowest finite value and returned it; ONNX's Attention body
    # compares the row max of its mask bias with -inf, so fully masked rows became NaN.
    init = [onnx.numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf")]
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=1),
        helper.make_node("Equal", ["m", "ninf"], ["e"]),
        helper.make_node("Cast", ["e"], ["y"], to=F),
    ]
    path = save_graph(tmp_path, nodes, {"x": (F, (3, 2))}, {"m": F, "y": F}, 17, init)
    lowest = np.finfo(np.float32).min
    _check(path, {"x": np.array([[-np.inf, -np.inf], [lowest, -np.inf], [1, 2]], np.float32)})


def test_space_to_depth_crd_bit_shift_past_width_and_bit_cast(tmp_path):
    # TVM ignored SpaceToDepth's mode (always DCR order), emitted undefined LLVM shifts for
    # shifts >= the width or negative, and had no BitCast converter.
    i32 = TensorProto.INT32
    nodes = [
        helper.make_node("SpaceToDepth", ["x"], ["s"], blocksize=2, mode="CRD"),
        helper.make_node("BitShift", ["a", "b"], ["r"], direction="RIGHT"),
        helper.make_node("BitCast", ["a"], ["f"], to=F),
    ]
    inputs = {"x": (F, (1, 2, 2, 4)), "a": (i32, (4,)), "b": (i32, (4,))}
    path = save_graph(tmp_path, nodes, inputs, {"s": F, "r": i32, "f": F}, 28)
    x = np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)
    a = np.array([-8, 4, -1, 1065353216], np.int32)  # the last one is 1.0's bits
    _check(path, {"x": x, "a": a, "b": np.array([32, 33, -1, 2], np.int32)})


def test_a_string_input_is_refused_naming_op_node_and_input(tmp_path):
    # TVM has no string type; its importer failed with "unknown dtype `object`".
    s = TensorProto.STRING
    node = helper.make_node("Equal", ["x", "y"], ["z"], name="same")
    path = save_graph(
        tmp_path, [node], {"x": (s, (2,)), "y": (s, (2,))}, {"z": TensorProto.BOOL}, 19
    )
    with pytest.raises(BuildError, match=r"op 'Equal' at node 'same'.*input 'x' is a string"):
        ek.build(path, backend="tvm", shapes={"x": [(2,)] * 3, "y": [(2,)] * 3})


def test_eye_like_takes_its_dtype_attribute(tmp_path):
    # TVM refused a dtype other than the input's ("dtype mismatch between input (int32)...").
    node = helper.make_node("EyeLike", ["x"], ["y"], dtype=F, k=1)
    path = save_graph(tmp_path, [node], {"x": (TensorProto.INT32, (3, 4))}, {"y": F}, 9)
    _check(path, {"x": np.zeros((3, 4), np.int32)})


def test_reduce_min_of_bools_and_of_an_empty_set(tmp_path):
    # TVM has no min value for bool ("Cannot decide max_value"), and over an empty set it
    # returned float32's highest finite value where ONNX's minimum is +inf.
    axes = onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("ReduceMin", ["b", "axes"], ["bmin"], keepdims=1),
        helper.make_node("ReduceMin", ["e", "axes"], ["emin"], keepdims=1),
    ]
    inputs = {"b": (TensorProto.BOOL, (2, 3)), "e": (F, (2, 0, 4))}
    path = save_graph(tmp_path, nodes, inputs, {"bmin": TensorProto.BOOL, "emin": F}, 20, [axes])
    b = np.array([[True, False, True], [True, True, True]])
    _check(path, {"b": b, "e": np.zeros((2, 0, 4), np.float32)})


def test_affine_grid_size_from_a_graph_input_builds(tmp_path):
    # The build's generated example size holds zeros and ones (random integers): TVM's
    # AffineGrid divided by zero at build, before verification could ask for verify_data.
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=1)
    inputs = {"theta": (F, (2, 2, 3)), "size": (TensorProto.INT64, (4,))}
    path = save_graph(tmp_path, [node], inputs, {"grid": F}, 20)
    theta = np.random.default_rng(0).standard_normal((2, 2, 3)).astype(np.float32)
    feeds = {"theta": theta, "size": np.array([2, 3, 4, 5], np.int64)}
    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with ek.build(path, backend="tvm", shapes=shapes, verify_data=feeds) as engine:
        got = engine.infer(feeds)["grid"]
    np.testing.assert_allclose(got, reference(path, feeds)["grid"], rtol=1e-5, atol=1e-6)


def test_rms_normalization_over_every_axis_with_a_broadcast_scale(tmp_path):
    # TVM's rms_norm wants the scale of the normalized shape; a last-dim scale over axis 0
    # failed to compile ("Tensor dimension mismatch in read").
    node = helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=0, epsilon=0.1)
    path = save_graph(tmp_path, [node], {"x": (F, (2, 3, 4)), "scale": (F, (4,))}, {"y": F}, 23)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "scale": rng.standard_normal(4).astype(np.float32),
    }
    matches_reference(path, feeds, "tvm", rtol=1e-5, atol=1e-6)


def test_pow_of_integers_and_of_mixed_types(tmp_path):
    # TVM refused an int32 base with a float32 exponent ("same datatype") and failed to
    # compile an integer power ("power only applies to float").
    nodes = [
        helper.make_node("Pow", ["i", "f"], ["mixed"]),
        helper.make_node("Pow", ["i", "i"], ["ints"]),
    ]
    inputs = {"i": (TensorProto.INT32, (3,)), "f": (F, (3,))}
    outputs = {"mixed": TensorProto.INT32, "ints": TensorProto.INT32}
    path = save_graph(tmp_path, nodes, inputs, outputs, 15)
    feeds = {"i": np.array([1, 2, 3], np.int32), "f": np.array([4.0, 5.0, 2.5], np.float32)}
    _check(path, feeds)


def test_celu_of_float16(tmp_path):
    # Celu's body is an Elu, whose TVM converter made float32 constants: "Binary operators
    # must have the same datatype" for float16.
    f16 = TensorProto.FLOAT16
    node = helper.make_node("Celu", ["x"], ["y"], alpha=2.0)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", f16, (5,))],
        [helper.make_tensor_value_info("y", f16, (5,))],
    )  # fmt: skip
    path = tmp_path / "celu.onnx"
    onnx.save(helper.make_model(graph), path)  # the newest opset, as ONNX's own case
    x = np.array([-3.0, -0.5, 0.0, 0.25, 4.0], np.float16)
    matches_reference(path, {"x": x}, "tvm", rtol=1e-3, atol=1e-3)


def test_one_hot_with_run_time_values_and_a_negative_axis(tmp_path):
    # TVM asserted "Only constant values currently supported"; its one_hot also took no
    # negative axis but -1. A float depth truncates.
    depth = onnx.numpy_helper.from_array(np.array(4.0, np.float32), "depth")
    node = helper.make_node("OneHot", ["i", "depth", "v"], ["y"], axis=-2)
    inputs = {"i": (TensorProto.INT64, (2, 3)), "v": (F, (2,))}
    path = save_graph(tmp_path, [node], inputs, {"y": F}, 11, [depth])
    feeds = {
        "i": np.array([[0, 3, -1], [2, -4, 1]], np.int64),
        "v": np.array([-1.5, 7.0], np.float32),
    }
    _check(path, feeds)


def test_window_ops_with_a_size_fed_at_run_time(tmp_path):
    # None had a converter; their expanded bodies lost the default `periodic` and
    # `output_datatype` (an empty Constant; a Cast with no 'to'). The size is a value input.
    nodes = [
        helper.make_node("HammingWindow", ["n"], ["hamming"], periodic=0),
        helper.make_node("HannWindow", ["n"], ["hann"]),
        helper.make_node("BlackmanWindow", ["n"], ["blackman"], output_datatype=11),
    ]
    outputs = {"hamming": F, "hann": F, "blackman": TensorProto.DOUBLE}
    path = save_graph(tmp_path, nodes, {"n": (TensorProto.INT32, ())}, outputs, 17)
    feeds = {"n": np.array(7, np.int32)}
    with ek.build(path, backend="tvm", shapes={"n": [()] * 3}, verify_data=feeds) as engine:
        got = engine.infer(feeds)
    for name, want in reference(path, feeds).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_float_floor_mod_by_infinity(tmp_path):
    # TVM's floor_mod is x - floor(x / y) * y: NaN for y = +-inf, where numpy's (and ONNX
    # Runtime's) mod(-3, inf) is inf and mod(3, inf) is 3.
    f64 = TensorProto.DOUBLE
    node = helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)
    inputs = {"x": (f64, (6,)), "y": (f64, (6,))}
    # Float Mod with fmod=0 is valid from opset 28 (ONNX Runtime refuses it before).
    path = save_graph(tmp_path, [node], inputs, {"z": f64}, onnx.defs.onnx_opset_version())
    x = np.array([-3.0, 3.0, -1.0, 1.0, 5.5, -5.5])
    y = np.array([np.inf, np.inf, -np.inf, -np.inf, -2.0, 2.0])
    _check(path, {"x": x, "y": y})


def test_slice_with_attributes_before_opset_10(tmp_path):
    # TVM converts only Slice's input form: "Cannot cast NoneType to list of Expr".
    node = helper.make_node("Slice", ["x"], ["y"], starts=[1, -3], ends=[9, 1000], axes=[0, 1])
    path = save_graph(tmp_path, [node], {"x": (F, (4, 5))}, {"y": F}, 9)
    _check(path, {"x": np.arange(20, dtype=np.float32).reshape(4, 5)})


def test_upsample_nearest_with_scales_as_an_input(tmp_path):
    # TVM read scales from the opset-7 attribute only ("NoneType has no len()"), and its
    # nearest rounded where ONNX floors: a scale of 3 took source pixel 1 for output 2.
    scales = onnx.numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")
    node = helper.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")
    path = save_graph(tmp_path, [node], {"x": (F, (1, 1, 2, 2))}, {"y": F}, 9, [scales])
    _check(path, {"x": np.array([[[[1, 2], [3, 4]]]], np.float32)})


def test_split_with_a_piece_of_size_zero(tmp_path):
    # TVM's split takes strictly increasing points: "split_indices must be sorted" after
    # import, an InternalError past the frontend's BuildError.
    sizes = onnx.numpy_helper.from_array(np.array([2, 0, 3], np.int64), "sizes")
    node = helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1)
    outputs = {"a": F, "b": F, "c": F}
    path = save_graph(tmp_path, [node], {"x": (F, (2, 5))}, outputs, 13, [sizes])
    _check(path, {"x": np.arange(10, dtype=np.float32).reshape(2, 5)})


def test_is_inf_detects_one_sign_only(tmp_path):
    # TVM ignored detect_negative / detect_positive and flagged both infinities.
    nodes = [
        helper.make_node("IsInf", ["x"], ["pos"], detect_negative=0),
        helper.make_node("IsInf", ["x"], ["neg"], detect_positive=0),
    ]
    b = TensorProto.BOOL
    path = save_graph(tmp_path, nodes, {"x": (F, (5,))}, {"pos": b, "neg": b}, 20)
    _check(path, {"x": np.array([-np.inf, -1.0, 0.0, np.inf, np.nan], np.float32)})
