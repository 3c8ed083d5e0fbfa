"""The bf16 float part of accuracy-aware int8 (enginekit/calibration/mixed.py): the search keeps
the layer bf16 rounding breaks in f32, meets the target, builds what it measured and says why;
without a bf16 float part it says why bf16 was not tried."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from calib_models import two_gemm

import enginekit as ek
from enginekit import backends, target
from enginekit.calibration.accuracy import ort_runner
from enginekit.calibration.search import AccuracyTarget
from enginekit.cli.build import plans_text

CLASSES = 6
SHAPES = {"x": [(1, 8), (16, 8), (64, 8)]}
BF16 = {"avx512_bf16", "amx_bf16"}


def offset_mlp() -> onnx.ModelProto:
    """x[batch,8] -> fc_a -> h[batch,8] -> fc_b -> logits[batch,6], fed ``256 + u`` with u in
    [0, 1): fc_a's columns sum to zero, so the common 256 cancels and h depends on u alone. In
    bf16 (8 significant bits) 256 + u rounds to 256 or 258, so fc_a in bf16 loses u and the
    class; fc_b is an ordinary layer, harmless in bf16."""
    rng = np.random.default_rng(0)
    wa = rng.standard_normal((8, 8)).astype(np.float32)
    wa -= wa.mean(axis=0, keepdims=True)
    wb = rng.standard_normal((8, CLASSES)).astype(np.float32)
    return two_gemm(wa, wb, ("fc_a", "fc_b"), "offset_mlp")


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return (256 + np.random.default_rng(1).random((300, 8))).astype(np.float32)


def _needs_bf16_openvino() -> None:
    if not backends.availability("openvino").available:
        pytest.skip("openvino is not installed here")
    if not BF16 & target.cpu_flags():
        pytest.skip("this CPU has no native bf16 (avx512_bf16, amx_bf16): no bf16 float part")


def _build_bf16(model, data, **options):
    return ek.build(
        model, backend="openvino", precision="int8", shapes=SHAPES, calib_data=data,
        int8_float_precision="bf16",
        accuracy_target=AccuracyTarget(min_top1_agreement=0.97, fallback="bf16"), **options,
    )  # fmt: skip


def test_the_bf16_sensitive_layer_is_kept_f32_and_the_target_met(data):
    """Without the f32 layer the bf16 float part agrees on ~10% of rows and no plan meets
    0.97 (every layer kept out of int8 runs bf16): the build fails verification."""
    _needs_bf16_openvino()
    engine = _build_bf16(offset_mlp(), data)
    found = engine.manifest["calibration"]["accuracy_search"]
    part = found["float_part"]
    assert part["precision"] == "bf16"
    assert [k["layer"] for k in part["f32_layers"]] == ["fc_a"]
    assert "bf16 sensitivity rank 1 of 2" in part["f32_layers"][0]["why"]
    assert part["f32_layers_chosen"].startswith("searched")
    # the float part alone, fewest f32 layers first: whole bf16 misses, fc_a f32 meets
    assert [(p["f32_layers"], p["met"]) for p in part["plans"]] == [(0, False), (1, True)]
    assert part["plans"][0]["top1_agreement"] < 0.5
    # what was measured is what is built: the option, the marks, the gate on the engine
    assert engine.manifest["config"]["options"]["f32_layers"] == ["fc_a"]
    assert engine.manifest["backend"]["metadata"]["f32_layers"]["layers"] == ["fc_a"]
    assert engine.manifest["verify"]["passed"]
    assert engine.manifest["verify"]["outputs"]["logits"]["top1_agreement"] >= 0.97
    assert found["chosen"]["met"]
    text = plans_text(found)
    assert "float part bf16" in text and "f32: fc_a (bf16 sensitivity rank 1" in text


def test_plans_are_timed_against_the_float32_model_not_the_bf16_one(data):
    """The float model every plan is timed against computes in f32 (exact on this model),
    where the bf16-hinted one loses fc_a's input: "x fp32" means fp32."""
    _needs_bf16_openvino()
    from enginekit.backends import openvino
    from enginekit.calibration.plan import _float_part
    from enginekit.config import BuildConfig
    from enginekit.model import load_model

    model = load_model(offset_mlp())
    config = BuildConfig(backend="openvino", precision="int8", profiles=(),
                         options={"int8_float_precision": "bf16"})  # fmt: skip
    rows = [{"x": data[i : i + 16]} for i in range(0, 64, 16)]
    fallback = ("bf16", "host has bf16")
    target_ = AccuracyTarget(0.97, fallback="bf16")
    _, chosen, float_runner, speed_vs = _float_part(
        model, config, openvino.plan_runner, fallback, rows, rows, target_
    )
    assert chosen == {"f32_layers": ["fc_a"]}
    assert speed_vs.startswith("openvino CPU float32")
    ref = ort_runner(model.proto)(rows[0])[0]
    assert np.abs(float_runner(model.proto)(rows[0])[0] - ref).max() < 1e-3
    bf16 = openvino.plan_runner(config)(model.proto)(rows[0])[0]
    assert np.abs(bf16 - ref).max() > 1.0


def test_f32_layers_given_as_the_option_are_kept_not_searched(data):
    _needs_bf16_openvino()
    engine = _build_bf16(offset_mlp(), data, f32_layers=["fc_a"])
    part = engine.manifest["calibration"]["accuracy_search"]["float_part"]
    assert part["f32_layers_chosen"] == "given: the f32_layers option"
    assert part["plans"] == []
    assert [k["layer"] for k in part["f32_layers"]] == ["fc_a"]
    assert engine.manifest["verify"]["passed"]


def test_without_a_bf16_float_part_the_manifest_says_why_bf16_was_not_tried(data):
    """Any host: ONNX Runtime runs the float layers in float32; the manifest and the printed
    report say so, and the speed is labelled with what it was timed against."""
    engine = ek.build(
        offset_mlp(), precision="int8", shapes=SHAPES, calib_data=data, verify=False,
        accuracy_target=AccuracyTarget(min_top1_agreement=0.5),
    )  # fmt: skip
    found = engine.manifest["calibration"]["accuracy_search"]
    part = found["float_part"]
    assert part["precision"] == "float"
    assert "runs the float layers of an int8 model in float32" in part["reason"]
    assert found["speed_vs"] == "ONNX Runtime CPU float32"
    text = plans_text(found)
    assert "float part float32, bf16 not tried: backend 'onnxruntime'" in text
    assert "x fp32: against ONNX Runtime CPU float32" in text


def test_auto_tries_int8_with_a_bf16_float_part_where_the_host_has_bf16(data):
    _needs_bf16_openvino()
    engine = ek.build(
        offset_mlp(), backend="auto", backends=["openvino"], precisions=["int8"],
        shapes=SHAPES, calib_data=data, bench_duration=0.2,
        accuracy_target=AccuracyTarget(min_top1_agreement=0.97),
    )  # fmt: skip
    auto = engine.manifest["auto"]
    assert auto["bf16_float_part"].startswith(
        "tried as openvino[int8, int8_float_precision=bf16]: host has"
    )
    records = {r["label"]: r for r in auto["candidates"]}
    mixed = records["openvino[int8, int8_float_precision=bf16]"]
    assert mixed["status"] == "passed", mixed
    assert mixed["verdict"].startswith(("won", "lost: slower"))
    assert "openvino[int8]" in records


def test_auto_says_why_no_bf16_float_part_was_tried_without_a_target():
    from enginekit.calibration.plan import Quantization
    from enginekit.evaluate.candidates import Candidate
    from enginekit.evaluate.choose import bf16_float_part

    todo = [(Candidate("openvino", {}, "int8"), [])]
    added, why = bf16_float_part(todo, Quantization())
    assert added == [] and why.startswith("not tried: no accuracy target")
    target_ = AccuracyTarget(0.97, fallback="float")
    added, why = bf16_float_part(todo, Quantization(target=target_))
    assert added == [] and "fallback is float" in why
