"""The scaled verification rule: accepts float32 reordering in deep networks with large outputs,
catches a weight tensor 1% off, and writes every statistic into the report and the manifest."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import enginekit as ek
from enginekit import backends
from enginekit.verify import check_output


def deep_mlp(depth: int = 12, width: int = 64, classes: int = 1000, gain: float = 3e4):
    """Random weights (He-scaled) and a last layer that makes logits of magnitude ~1e4."""
    rng = np.random.default_rng(0)
    sizes = [width] * depth + [classes]
    ws = [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
          for a, b in zip([width, *sizes[:-1]], sizes)]  # fmt: skip
    ws[-1] *= np.float32(gain / np.sqrt(width))
    return ws


def forward(x: np.ndarray, ws: list[np.ndarray], reverse: bool = False) -> np.ndarray:
    """float32 forward pass; ``reverse`` sums every dot product in the opposite order (as a
    differently blocked GEMM does): both are correct float32 results."""
    for i, w in enumerate(ws):
        if reverse:
            x = np.einsum("bk,kn->bn", x[:, ::-1], w[::-1], dtype=np.float32, optimize=False)
        else:
            x = x @ w
        if i < len(ws) - 1:
            x = np.maximum(x, 0)
    return x


def test_float32_reordering_in_a_deep_net_fails_elementwise_and_passes_scaled():
    ws = deep_mlp()
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    ref, got = forward(x, ws), forward(x, ws, reverse=True)
    assert np.abs(ref).max() > 1e3  # large logits, and some of them near zero
    old = check_output("logits", got, ref, 1e-4, 1e-3, rule="elementwise")
    new = check_output("logits", got, ref, *ek.BuildConfig().tolerance)
    assert not old.passed and old.mismatch > 0
    assert new.passed, new
    assert new.scaled_error < 1e-5 and new.cosine > 0.999999


def test_one_weight_tensor_one_percent_off_fails_the_scaled_rule():
    ws = deep_mlp()
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    ref = forward(x, ws)
    for layer in (0, 6, len(ws) - 1):
        wrong = list(ws)
        wrong[layer] = ws[layer] * np.float32(1.01)
        c = check_output("logits", forward(x, wrong), ref, *ek.BuildConfig().tolerance)
        assert not c.passed and c.scaled_error > 1e-3, (layer, c.scaled_error)


def test_scaled_rule_statistics_and_edges():
    ref = np.array([[1000.0, -1.0, 0.0, 2.0]], np.float32)
    got = ref + np.array([[0.05, 0.05, -0.05, 0.0]], np.float32)
    c = check_output("y", got, ref, 1e-6, 1e-4)
    assert c.rule == "scaled" and c.scale == 1000.0
    assert c.scaled_error == pytest.approx(5e-5, rel=1e-3) and c.bound == pytest.approx(0.100001)
    assert c.passed
    assert not check_output("y", got, ref, 1e-6, 1e-5).passed
    # an output of zeros: the absolute floor decides, the cosine of noise is not gated
    zeros = np.zeros(4, np.float32)
    noise = np.array([1e-8, -1e-8, 0, 0], np.float32)
    z = check_output("z", noise, zeros, 1e-6, 1e-4, min_cosine=0.9999)
    assert z.passed and z.scale == 0.0
    # integer outputs match exactly under the scaled rule
    ids = np.arange(10_000, dtype=np.int64)
    off = ids.copy()
    off[5] += 1
    assert not check_output("ids", off, ids, 1e-6, 1e-4).passed
    assert check_output("ids", ids.copy(), ids, 1e-6, 1e-4).passed


def test_cosine_floor_catches_errors_spread_under_one_large_element():
    ref = np.ones(100_000, np.float64)
    ref[0] = 1e4
    got = ref + 0.5  # within 1e-4 of the scale everywhere, wrong everywhere but one element
    got[0] = ref[0]
    c = check_output("y", got, ref, 1e-6, 1e-4, min_cosine=0.9999)
    assert c.allclose and not c.passed and "cosine" in c.error


def deep_cnn(depth: int = 8, ch: int = 32, classes: int = 1000, gain: float = 3000.0):
    """A random CNN whose logits reach ~1e4; ONNX Runtime's optimized convolutions differ
    from the reference's by float32 reordering."""
    rng = np.random.default_rng(0)
    nodes, inits, x, cin = [], [], "x", 3
    for i in range(depth):
        w = (rng.standard_normal((ch, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        b = (rng.standard_normal(ch) * 0.1).astype(np.float32)
        inits += [nh.from_array(w, f"w{i}"), nh.from_array(b, f"b{i}")]
        nodes += [
            h.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            h.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        x, cin = f"r{i}", ch
    fw = (rng.standard_normal((classes, ch)) * gain / np.sqrt(ch)).astype(np.float32)
    inits += [nh.from_array(fw, "fw"), nh.from_array(np.zeros(classes, np.float32), "fb")]
    nodes += [
        h.make_node("GlobalAveragePool", [x], ["g"]),
        h.make_node("Flatten", ["g"], ["f"]),
        h.make_node("Gemm", ["f", "fw", "fb"], ["logits"], transB=1),
    ]
    graph = h.make_graph(
        nodes,
        "deep_cnn",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [h.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_deep_cnn_builds_at_default_settings_and_reports_every_statistic(tmp_path):
    out = tmp_path / "cnn.ekit"
    engine = ek.build(deep_cnn(), output=out)
    engine.close()
    report = ek.load(out).manifest["verify"]
    assert report["passed"] and report["rule"] == "scaled"
    assert report["atol"] == 1e-6 and report["rtol"] == 1e-4 and report["min_cosine"] == 0.9999
    worst = report["worst"]["logits"]
    assert worst["scale"] > 1e3 and worst["scaled_error"] < 1e-5
    for key in ("max_abs", "max_rel", "mean_abs", "p99_abs", "cosine", "top1", "topk", "k",
                "bound", "mismatch"):  # fmt: skip
        assert key in worst, key
    json.dumps(report, allow_nan=False)


def test_a_weight_tensor_one_percent_off_fails_the_build(monkeypatch):
    monkeypatch.setitem(backends._BUILTIN, "scaled_weight", "scaled_weight_backend")
    with pytest.raises(ek.VerificationError, match="of the output's scale") as info:
        ek.build(deep_cnn(), backend="scaled_weight")
    assert info.value.report["worst"]["logits"]["scaled_error"] > 1e-3


def test_elementwise_rule_stays_available_by_name():
    engine = ek.build(deep_cnn(depth=2, gain=1.0), rule="elementwise")
    report = engine.manifest["verify"]
    assert report["rule"] == "elementwise" and report["atol"] == 1e-4 and report["rtol"] == 1e-3
    with pytest.raises(ek.BuildError, match="did you mean 'scaled'"):
        ek.build(deep_cnn(depth=2), rule="scaleed")


def test_verify_data_works_at_fp32_from_arrays_npz_and_a_folder(tmp_path):
    model = deep_cnn(depth=2, gain=1.0)
    x = np.random.default_rng(3).standard_normal((5, 3, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "folder" / "x.npy", x)
    for data in (x, {"x": x}, tmp_path / "data.npz", tmp_path / "folder"):
        report = ek.build(model, verify_data=data).manifest["verify"]
        assert report["passed"] and report["data"] == "verify_data"
        assert report["cases"][0]["shapes"] == {"x": [5, 3, 32, 32]}


def test_verify_data_with_a_wrong_input_name_says_so():
    x = np.zeros((2, 3, 32, 32), np.float32)
    with pytest.raises(ek.EnginekitError, match="'y'|'x'"):
        ek.build(deep_cnn(depth=2, gain=1.0), verify_data={"y": x})


def test_failure_message_names_the_model_and_the_scaled_numbers(monkeypatch, tmp_path):
    monkeypatch.setitem(backends._BUILTIN, "scaled_weight", "scaled_weight_backend")
    path = tmp_path / "deep.onnx"
    onnx.save(deep_cnn(depth=2, gain=1.0), str(path))
    with pytest.raises(ek.VerificationError) as info:
        ek.build(path, backend="scaled_weight")
    text = str(info.value)
    assert str(path) in text and "max|ref|" in text and "cosine" in text


def test_a_changed_first_embedding_row_fails_because_token_ids_cover_the_vocabulary_ends(
    monkeypatch,
):
    # broken_backend adds 1.0 to the first element of the largest weight: here row 0 of the
    # embedding table, which only token id 0 reads.
    monkeypatch.setitem(backends._BUILTIN, "broken", "broken_backend")
    rng = np.random.default_rng(0)
    graph = h.make_graph(
        [
            h.make_node("Gather", ["emb", "ids"], ["e"]),
            h.make_node("ReduceMean", ["e", "axes"], ["y"], keepdims=0),  # opset 18: axes input
        ],
        "embedding",
        [h.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 6])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [
            nh.from_array(rng.standard_normal((5000, 8)).astype(np.float32), "emb"),
            nh.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    assert ek.build(m).manifest["verify"]["passed"]
    with pytest.raises(ek.VerificationError):
        ek.build(m, backend="broken")
