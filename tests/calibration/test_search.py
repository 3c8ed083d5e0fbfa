"""Accuracy-aware int8 (enginekit/calibration/search.py): the search keeps the sensitive layer
in float to meet the target, records why, and refuses bad targets with typed errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from calib_models import two_gemm
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek
from enginekit.calibration.scoring import lower_bound, measure, rows_to_resolve, wilson
from enginekit.calibration.search import AccuracyTarget, fallback_precision, search
from enginekit.calibration.writers import write_qdq
from enginekit.errors import BuildError, CalibrationError, VerificationError

CLASSES = 6
SHAPES = {"x": [(1, 8), (16, 8), (64, 8)]}


def outlier_mlp() -> onnx.ModelProto:
    """x[batch,8] -> fc1 -> h[batch,8] -> fc2 -> logits[batch,6]. One channel of ``h`` is
    1000x the others and fc2 ignores it: a per-tensor int8 range for ``h`` (fc2's input)
    rounds the channels that matter to a few levels, while fc1 quantizes well. The search must
    keep fc2, and only fc2, in float."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 8)).astype(np.float32)
    w1[:, 7] *= 1000.0
    w2 = rng.standard_normal((8, CLASSES)).astype(np.float32)
    w2[7, :] = 0.0
    return two_gemm(w1, w2, ("fc1", "fc2"), "outlier_mlp")


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((300, 8)).astype(np.float32)


def _build(model, data, **kwargs):
    return ek.build(model, precision="int8", shapes=SHAPES, calib_data=data, **kwargs)


def test_search_keeps_the_sensitive_layer_in_float_to_meet_the_target(data):
    target = AccuracyTarget(min_top1_agreement=0.97)
    engine = _build(outlier_mlp(), data, accuracy_target=target)
    found = engine.manifest["calibration"]["accuracy_search"]
    # 300 samples: 150 held out (every 2nd of the first 300), not 30 (every 10th)
    assert found["measured_on"] == "ONNX Runtime CPU, 150 held-out rows"
    assert [k["layer"] for k in found["kept_in_float"]] == ["fc2"]
    assert "sensitivity rank 1 of 2" in found["kept_in_float"][0]["why"]
    plans = found["plans"]
    # every plain int8 plan (one per calibration method) misses; the chosen one is reported
    assert [p["float_layers"] for p in plans[:-1]] == [0] * (len(plans) - 1)
    assert not any(p["met"] for p in plans[:-1])
    assert plans[-1]["met"] and plans[-1]["float_layers"] == 1
    # each plan's speed-up is against the float model timed beside it, not one time for all
    for p in plans:
        assert p["speedup_vs_fp32"] == pytest.approx(p["float_seconds"] / p["seconds"])
    assert len({p["float_seconds"] for p in plans}) == len(plans)
    assert found["chosen"]["float_layers"] == 1
    # fc2 (8 -> 6) is 48 of the 112 MACs a row; the all-int8 plans run none in float
    assert found["chosen"]["float_macs_share"] == pytest.approx(48 / 112)
    assert {p["float_macs_share"] for p in plans[:-1]} == {0.0}
    # the target is also the build's gate, checked on the engine itself
    verify = engine.manifest["verify"]
    assert verify["gates"]["min_top1_agreement"] == 0.97
    assert verify["outputs"]["logits"]["top1_agreement"] >= 0.97


def test_plain_int8_meeting_the_target_keeps_no_layer_in_float(data):
    engine = _build(outlier_mlp(), data, accuracy_target=AccuracyTarget(max_abs_error=1e9))
    found = engine.manifest["calibration"]["accuracy_search"]
    assert found["kept_in_float"] == [] and found["chosen"]["float_layers"] == 0


def test_the_int8_layers_left_run_integer_kernels(data):
    engine = _build(outlier_mlp(), data, accuracy_target=AccuracyTarget(min_top1_agreement=0.97))
    payload = engine.artifact.path / "payload"
    model = onnx.load(str(next(payload.rglob("*.onnx"))))
    maker = {o: n.op_type for n in model.graph.node for o in n.output}
    assert maker["h"] == "QGemm"  # fc1: ONNX Runtime's integer Gemm
    assert maker["logits"] == "Gemm"  # fc2: kept in float


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "needs min_top1_agreement"),
        ({"min_top1_agreement": 1.5}, r"expected a fraction in \(0, 1\]"),
        ({"min_top1_agreement": 0.0}, r"expected a fraction in \(0, 1\]"),
        ({"max_abs_error": -1.0}, "expected a number >= 0"),
        ({"min_top1_agreement": 0.9, "fallback": "bf61"}, "did you mean 'bf16'"),
        ({"min_top1_agreement": 0.9, "max_plans": 0}, "expected >= 1"),
    ],
)
def test_bad_targets_are_refused_with_what_was_expected(kwargs, match):
    with pytest.raises(BuildError, match=match):
        AccuracyTarget(**kwargs)


def test_cli_form_of_the_target_parses_and_names_a_bad_key():
    assert AccuracyTarget.parse("top1=0.97") == AccuracyTarget(min_top1_agreement=0.97)
    assert AccuracyTarget.parse("0.95,fallback=float") == AccuracyTarget(
        min_top1_agreement=0.95, fallback="float"
    )
    assert AccuracyTarget.parse("max_abs=0.5").max_abs_error == 0.5
    with pytest.raises(BuildError, match="did you mean 'top1'"):
        AccuracyTarget.parse("top=0.97")
    with pytest.raises(BuildError, match="is not a number"):
        AccuracyTarget.parse("top1=high")


def test_a_target_without_held_out_rows_is_refused(data):
    table = ek.calibrate(outlier_mlp(), data)
    target = AccuracyTarget(min_top1_agreement=0.97)
    with pytest.raises(CalibrationError, match="needs held-out rows"):
        ek.build(outlier_mlp(), precision="int8", shapes=SHAPES, calibration=table,
                 accuracy_target=target)  # fmt: skip


def test_a_target_is_for_int8_builds_only(data):
    with pytest.raises(BuildError, match="accuracy_target: for precision='int8'"):
        ek.build(outlier_mlp(), shapes=SHAPES, accuracy_target=AccuracyTarget(0.9))


def test_bf16_fallback_is_refused_without_native_bf16_and_auto_falls_back_to_float():
    with pytest.raises(BuildError, match="fallback='bf16' refused: this CPU has none of"):
        fallback_precision(AccuracyTarget(0.9, fallback="bf16"), "openvino", flags=set())
    precision, why = fallback_precision(AccuracyTarget(0.9), "openvino", flags=set())
    assert precision == "float" and "no native bf16" in why
    precision, why = fallback_precision(AccuracyTarget(0.9), "onnxruntime", flags={"avx512_bf16"})
    assert precision == "float" and "runs the float layers of an int8 model in float32" in why


def test_bf16_fallback_on_openvino_follows_its_int8_float_precision_option():
    """bf16 costs agreement (docs/calibration.md), so it is opt-in: the OpenVINO option
    int8_float_precision=bf16 asks for it; auto follows the option; contradictions are refused."""
    bf16 = {"avx512_bf16"}
    ask = {"int8_float_precision": "bf16"}
    precision, why = fallback_precision(AccuracyTarget(0.9), "openvino", flags=bf16)
    assert precision == "float" and "int8_float_precision is not bf16" in why
    for fallback in ("auto", "bf16"):
        target = AccuracyTarget(0.9, fallback=fallback)
        precision, why = fallback_precision(target, "openvino", flags=bf16, options=ask)
        assert precision == "bf16" and "int8_float_precision=bf16" in why
    with pytest.raises(BuildError, match="set the openvino option int8_float_precision=bf16"):
        fallback_precision(AccuracyTarget(0.9, fallback="bf16"), "openvino", flags=bf16)
    with pytest.raises(BuildError, match="fallback='float' contradicts the openvino option"):
        fallback_precision(AccuracyTarget(0.9, fallback="float"), "openvino", bf16, ask)
    with pytest.raises(BuildError, match="this CPU has none of"):
        fallback_precision(AccuracyTarget(0.9, fallback="bf16"), "openvino", set(), ask)


def test_measure_reports_the_lowest_top1_agreement_and_normalized_error():
    ref = [[np.array([[1.0, 0.0], [0.0, 1.0]])]]
    got = [[np.array([[1.0, 0.0], [1.0, 0.5]])]]
    m = measure(got, ref)
    assert m["top1_agreement"] == 0.5 and m["max_abs"] == 1.0
    assert m["nmse"] == pytest.approx(1.25 / 2.0)


def test_cli_accuracy_target_flag_builds_and_prints_every_plan(data, tmp_path, capsys):
    from enginekit.cli import main

    model, npy = tmp_path / "mlp.onnx", tmp_path / "calib.npy"
    onnx.save_model(outlier_mlp(), str(model))
    np.save(npy, data)
    code = main([
        "build", str(model), "--precision", "int8", "--shapes", "x:1x8,16x8,64x8",
        "--calib-data", str(npy), "--accuracy-target", "top1=0.97", "-o", str(tmp_path / "e.ekit"),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "every plan tried" in out and "kept in float" in out and "fc2" in out


def test_openvino_measures_the_plans_with_its_own_int8_kernels(data):
    from enginekit import backends

    if not backends.availability("openvino").available:
        pytest.skip("openvino is not installed here")
    engine = _build(
        outlier_mlp(), data, backend="openvino",
        accuracy_target=AccuracyTarget(min_top1_agreement=0.9),
    )  # fmt: skip
    found = engine.manifest["calibration"]["accuracy_search"]
    assert found["measured_on"].startswith("openvino CPU")
    assert "fc2" in [k["layer"] for k in found["kept_in_float"]]


def conv_pair() -> onnx.ModelProto:
    """x[batch,3,4,4] -> Conv 1x1 (channel ranges 0.01..10) -> Relu -> Conv 1x1 -> GAP ->
    logits[batch,6]: one pair cross-layer equalization rescales."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 3, 1, 1)).astype(np.float32)
    w1 *= np.logspace(-2, 1, 8, dtype=np.float32).reshape(8, 1, 1, 1)
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.standard_normal((CLASSES, 8, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["logits"], name="flatten"),
    ]
    graph = helper.make_graph(
        nodes, "conv_pair",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_cle_equalizes_before_calibration_and_the_manifest_says_so():
    data = np.random.default_rng(2).standard_normal((120, 3, 4, 4)).astype(np.float32)
    target = AccuracyTarget.parse("max_abs=1e9,cle=on")
    assert target.equalize
    engine = ek.build(
        conv_pair(), precision="int8", calib_data=data, accuracy_target=target,
        shapes={"x": [(1, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4)]},
    )  # fmt: skip
    done = engine.manifest["calibration"]["equalization"]
    assert done["pass"] == "cross_layer_equalization" and done["pairs"] == 1
    assert done["weight_range_spread_after"] < done["weight_range_spread_before"]
    assert engine.manifest["calibration"]["accuracy_search"]["target"]["equalize"] is True
    with pytest.raises(BuildError, match="is not on or off"):
        AccuracyTarget.parse("top1=0.9,cle=maybe")
    with pytest.raises(BuildError, match="pass calib_data= instead of calibration="):
        ek.build(
            conv_pair(), precision="int8", calibration=ek.calibrate(conv_pair(), data),
            accuracy_target=target, shapes={"x": [(1, 3, 4, 4), (8, 3, 4, 4), (16, 3, 4, 4)]},
        )  # fmt: skip


def test_measure_reports_the_rows_and_a_wilson_interval_around_the_agreement():
    ref = [[np.eye(4, dtype=np.float32)[[0, 1, 2, 3] * 25]]]
    got = [[ref[0][0].copy()]]
    got[0][0][:3] = np.roll(got[0][0][:3], 1, axis=1)  # 3 of 100 rows disagree
    m = measure(got, ref)
    assert m["rows"] == 100 and m["top1_agreement"] == pytest.approx(0.97)
    low, high = m["top1_interval"]
    assert low == pytest.approx(0.9155, abs=1e-3) and high == pytest.approx(0.9897, abs=1e-3)
    # 30 rows cannot tell 97% from 100%: all 30 agreeing is still consistent with 89%
    assert wilson(1.0, 30)[0] < 0.89 and wilson(0.97, 150)[0] > wilson(0.97, 30)[0]


def test_too_few_rows_for_the_target_are_warned_about(data, caplog):
    small = data[:100]  # 50 held out: 97% allows one row to disagree, 99.5% none
    with caplog.at_level("WARNING", logger="enginekit.calibration.search"):
        _build(outlier_mlp(), small, accuracy_target=AccuracyTarget(min_top1_agreement=0.97))
    assert "allows no row to disagree" not in caplog.text
    with caplog.at_level("WARNING", logger="enginekit.calibration.search"):
        _build(outlier_mlp(), small, accuracy_target=AccuracyTarget(min_top1_agreement=0.995))
    assert "on 50 held-out rows allows no row to disagree" in caplog.text
    assert "it needs at least 200 rows" in caplog.text


def test_sums_gptq_and_bias_are_tried_on_every_calibration_method():
    from test_rounding import edge_detectors

    source = edge_detectors()
    rng = np.random.default_rng(3)
    x = (rng.random((48, 16, 8, 8)) * 4 + 1).astype(np.float32)
    table = ek.calibrate(source, {"x": x[:32]}, method="entropy")
    rows = [{"x": x[32:]}]
    found = search(
        source, table, rows, AccuracyTarget(max_abs_error=0.0, max_plans=1),
        lambda t: write_qdq(source, t, style="onnxruntime-cpu"), fit_rows=[{"x": x[:32]}],
    )  # fmt: skip
    tried = [p.method for p in found.plans if not p.kept]
    for method in ("entropy", "percentile", "minmax"):
        variants = {method, f"{method}+sums", f"{method}+sums+bias", f"{method}+gptq"}
        assert variants <= set(tried), tried
    # the layers kept in float are chosen from the most accurate all-int8 plan (ties: any)
    nmse = {p.method: p.metrics["nmse"] for p in found.plans if not p.kept}
    assert all(nmse[p.method] == min(nmse.values()) for p in found.plans if p.kept)


def test_bias_correction_and_sensitivity_are_fitted_on_calibration_rows_never_held_out(
    monkeypatch,
):
    """What shapes a plan is fitted on calibration rows; the held-out rows only score it
    (bias means taken on the rows a plan is then scored on flattered its agreement)."""
    from test_rounding import edge_detectors

    from enginekit.calibration import bias, plan
    from enginekit.calibration import search as search_module

    seen: dict[str, list] = {
        "bias": [], "sensitivity": [], "scored": [], "gptq": [], "sequential": []
    }  # fmt: skip

    def spy(name, real, index):
        def wrapped(*args, **kwargs):
            seen[name].extend(args[index])
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(search_module, "correct_bias", spy("bias", bias.correct_bias, 2))
    monkeypatch.setattr(search_module, "gptq_round", spy("gptq", search_module.gptq_round, 2))
    monkeypatch.setattr(
        search_module,
        "correct_bias_sequential",
        spy("sequential", bias.correct_bias_sequential, 2),
    )
    monkeypatch.setattr(
        search_module, "_sensitivity", spy("sensitivity", search_module._sensitivity, 3)
    )
    monkeypatch.setattr(plan, "search", spy("scored", search_module.search, 2))
    rng = np.random.default_rng(4)
    x = (rng.random((40, 16, 8, 8)) * 4 + 1).astype(np.float32)
    small, large = (1, 16, 8, 8), (8, 16, 8, 8)
    # An unreachable target, so that every fitted step runs (and verification then fails).
    with pytest.raises(VerificationError):
        ek.build(
            edge_detectors(), precision="int8", shapes={"x": [small, large, large]},
            calib_data={"x": x}, accuracy_target=AccuracyTarget(max_abs_error=0.0, max_plans=1),
        )  # fmt: skip

    def samples(batches):
        return {row.tobytes() for feeds in batches for row in feeds["x"]}

    held, every = samples(seen["scored"]), {row.tobytes() for row in x}
    fitted_bias, fitted_sensitivity = samples(seen["bias"]), samples(seen["sensitivity"])
    assert held and fitted_bias and fitted_sensitivity
    fitted_gptq = samples(seen["gptq"])
    assert fitted_gptq and not held & fitted_gptq, "GPTQ rounding saw held-out rows"
    assert not held & fitted_bias, "bias correction saw held-out rows"
    fitted_sequential = samples(seen["sequential"])
    assert fitted_sequential and not held & fitted_sequential, "sequential bias saw held-out rows"
    assert not held & fitted_sensitivity, "the sensitivity ranking saw held-out rows"
    assert fitted_bias <= every - held and fitted_sensitivity <= every - held


def test_without_calibration_rows_bias_correction_is_skipped_and_the_manifest_says_so():
    from test_rounding import edge_detectors

    source = edge_detectors()
    x = (np.random.default_rng(5).random((24, 16, 8, 8)) * 4 + 1).astype(np.float32)
    table = ek.calibrate(source, {"x": x[:16]}, method="minmax")
    found = search(
        source, table, [{"x": x[16:]}], AccuracyTarget(max_abs_error=0.0, max_plans=1),
        lambda t: write_qdq(source, t, style="onnxruntime-cpu"),
    )  # fmt: skip
    assert not any("bias" in p.method or "gptq" in p.method for p in found.plans)
    entry = found.manifest_entry(AccuracyTarget(max_abs_error=0.0))
    assert "bias correction skipped" in entry["fitted_on"]


def test_a_plan_meets_the_target_on_the_lower_bound_of_its_agreement_not_as_read():
    """146 of 150 rows (97.3%) read above a 97% target but could well be below it on new
    data: at the default 80% confidence the search asks for 148 of 150; at 0.5 the agreement
    as read decides (the old rule)."""
    target = AccuracyTarget(min_top1_agreement=0.97)
    assert target.confidence == 0.8
    read = {"top1_agreement": 146 / 150, "rows": 150, "max_abs": 0.0}
    assert not target.met(read)
    assert target.met({**read, "top1_agreement": 148 / 150})
    assert AccuracyTarget(min_top1_agreement=0.97, confidence=0.5).met(read)
    assert lower_bound(146 / 150, 150, 0.5) == pytest.approx(146 / 150)
    assert lower_bound(148 / 150, 150, 0.8) >= 0.97 > lower_bound(147 / 150, 150, 0.8)
    # Rows too few for any agreement to clear it: only every row agreeing is accepted.
    assert rows_to_resolve(0.97, 0.8) == 23 and lower_bound(1.0, 20, 0.8) < 0.97
    few = {"top1_agreement": 1.0, "rows": 20, "max_abs": 0.0}
    assert target.met(few) and not target.met({**few, "top1_agreement": 19 / 20})
    assert AccuracyTarget.parse("top1=0.97,confidence=0.9").confidence == 0.9
    with pytest.raises(BuildError, match=r"confidence=1\.5: expected a probability in \[0\.5, 1\)"):
        AccuracyTarget(min_top1_agreement=0.97, confidence=1.5)


def test_bases_are_ranked_by_output_error_before_agreement():
    """A base reading a few held-out rows more but with a larger output error is not the one
    the float layers are chosen from (one row is 0.7 points on 150 rows); meeting the target
    still comes first."""
    from enginekit.calibration.search import Plan, _rank

    def plan(agree: float, nmse: float, met: bool = False) -> Plan:
        metrics = {"top1_agreement": agree, "nmse": nmse, "max_abs": 1.0, "rows": 150}
        return Plan("m", (), metrics, 1.0, met, 1.0)

    noisy, accurate = plan(0.867, 0.0154), plan(0.827, 0.0137)
    assert max((noisy, accurate), key=_rank) is accurate
    assert max((plan(0.99, 0.02, met=True), accurate), key=_rank).met


@pytest.mark.parametrize(("needed", "measured"), [(40, [1, 2, 4, 8, 16, 32, 48, 40, 36, 38, 39]),
                                                  (64, [1, 2, 4, 8, 16, 32, 48, 56, 60, 62, 63, 64])])  # fmt: skip
def test_every_layer_in_float_is_measured_only_when_nothing_less_meets_the_target(
    monkeypatch, needed, measured
):
    """The all-float plan is the float model: it bounds the bisection unmeasured."""
    from enginekit.calibration import search as search_module
    from enginekit.calibration.search import Plan, _fallback_search

    monkeypatch.setattr(search_module, "keep_float", lambda base, source, kept: None)
    seen: list[int] = []

    def evaluate(method, proto, kept):
        seen.append(len(kept))
        return Plan(method, tuple(kept), {}, 1.0, len(kept) >= needed, 1.0)

    order = [f"layer{i}" for i in range(64)]
    found = _fallback_search(None, None, "m", order, AccuracyTarget(0.97, max_plans=12), evaluate)
    assert seen == measured and found is not None and len(found.kept) == needed


def test_final_timing_picks_a_cheap_plan_unless_another_is_clearly_faster():
    from enginekit.calibration.search import FINAL_MARGIN, Plan, _final_timing, _measured_fastest

    def plan(share: float, speedup: float | None = None) -> Plan:
        metrics = {"top1_agreement": 1.0, "max_abs": 0.0, "nmse": 0.0}
        return Plan("percentile", ("a",), metrics, 1.0, True, 1.0, share, speedup)

    cheapest = plan(0.1, 1.30)
    # Within the margin the cheapest in float MACs stays: timings differ by noise.
    assert _measured_fastest([cheapest, plan(0.2, 1.30 * (1 + FINAL_MARGIN / 2))]) is cheapest
    faster = plan(0.2, 1.30 * (1 + 2 * FINAL_MARGIN))
    assert _measured_fastest([cheapest, faster]) is faster

    calls: list[str] = []

    def runner(name: str):
        return lambda feeds: calls.append(name)

    first, second = plan(0.1), plan(0.2)
    timed = _final_timing(
        runner("fp32"), lambda proto: runner(proto.graph.name),
        [(first, helper.make_model(helper.make_graph([], "one", [], []))),
         (second, helper.make_model(helper.make_graph([], "two", [], [])))],
        {"x": np.zeros(1, np.float32)},
    )  # fmt: skip
    assert set(timed) == {id(first), id(second)}
    assert all(p.final_speedup is not None and p.final_speedup > 0 for p in timed.values())
    # The float model and the plans take turns (after one warm-up run each).
    assert calls[3:6] == ["fp32", "one", "two"] and calls.count("two") == calls.count("fp32")
    assert timed[id(first)].to_json()["final_speedup_vs_fp32"] == timed[id(first)].final_speedup
    from enginekit.cli.build import plans_text

    found = {
        "measured_on": "ONNX Runtime CPU, 1 held-out rows", "plans": [timed[id(first)].to_json()],
        "kept_in_float": [], "fallback_precision": "float", "fallback_reason": "float32",
    }  # fmt: skip
    assert "(final timing " in plans_text(found)
