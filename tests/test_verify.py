"""check_output under the elementwise rule: error metrics, the tolerance gate at its edges, NaN and
infinities, top-k. The scaled rule (the default) is tested in test_verify_rule.py."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from enginekit import verify
from enginekit.verify import compare_outputs, summarize

check_output = partial(verify.check_output, rule="elementwise")

ATOL, RTOL = 1e-4, 1e-3


def test_identical_outputs_pass_with_zero_error():
    ref = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    c = check_output("y", ref.copy(), ref, ATOL, RTOL)
    assert c.passed and c.error is None
    assert c.max_abs == c.max_rel == c.p99_abs == c.mismatch == 0.0
    assert c.cosine == pytest.approx(1.0)


def test_error_exactly_at_atol_passes_and_one_ulp_past_fails():
    ref = np.zeros(3)
    at = np.array([0.0, ATOL, -ATOL])
    assert check_output("y", at, ref, ATOL, RTOL).passed
    past = np.array([0.0, np.nextafter(ATOL, 1.0), 0.0])
    c = check_output("y", past, ref, ATOL, RTOL)
    assert not c.passed
    assert c.worst == (1,)
    assert c.mismatch == pytest.approx(1 / 3)


def test_rtol_scales_with_the_reference_magnitude_of_either_sign():
    ref = np.array([1000.0, -1000.0])
    assert check_output("y", ref + np.array([0.5, -0.5]), ref, 0.0, RTOL).passed
    c = check_output("y", ref + np.array([1.5, 0.0]), ref, 0.0, RTOL)
    assert not c.passed
    assert c.max_abs == pytest.approx(1.5)
    assert c.max_rel == pytest.approx(1.5e-3)


def test_nan_in_engine_output_is_a_failure_not_a_pass():
    ref = np.ones((2, 2), np.float32)
    got = ref.copy()
    got[0, 1] = np.nan
    c = check_output("y", got, ref, 1e9, 1e9)  # no tolerance lets NaN through
    assert not c.passed
    assert c.nan == 1 and c.ref_nan == 0
    assert "NaN where the reference has a number" in c.error
    # strict JSON: the infinite max error becomes null rather than Infinity
    text = json.dumps(c.to_json(), allow_nan=False)
    assert json.loads(text)["max_abs"] is None


def test_nan_in_both_fails_unless_equal_nan():
    ref = np.array([1.0, np.nan])
    got = np.array([1.0, np.nan])
    strict = check_output("y", got, ref, ATOL, RTOL)
    assert not strict.passed and "NaN in both" in strict.error
    assert check_output("y", got, ref, ATOL, RTOL, equal_nan=True).passed


def test_equal_infinities_agree_and_a_finite_value_never_matches_an_infinite_one():
    ref = np.array([np.inf, -np.inf, 1.0])
    assert check_output("y", ref.copy(), ref, ATOL, RTOL).passed
    assert not check_output("y", np.array([1e30, -np.inf, 1.0]), ref, ATOL, RTOL).passed
    assert not check_output("y", np.array([np.inf, np.inf, 1.0]), ref, ATOL, RTOL).passed


def test_shape_mismatch_and_missing_output_fail_with_the_reason():
    ref = np.zeros((2, 3))
    c = check_output("y", np.zeros((3, 2)), ref, ATOL, RTOL)
    assert not c.passed and "shape (3, 2)" in c.error
    missing = check_output("y", None, ref, ATOL, RTOL)
    assert not missing.passed and "no such output" in missing.error


def test_topk_agreement_on_classifier_shaped_outputs():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((4, 10)).astype(np.float32)
    got = ref.copy()
    top = np.argsort(-ref[0])[:2]
    got[0, top[0]], got[0, top[1]] = ref[0, top[1]], ref[0, top[0]]  # swap row 0's top two
    c = check_output("logits", got, ref, ATOL, RTOL, topk=5)
    assert not c.passed
    assert c.top1 == pytest.approx(0.75)
    assert c.topk == pytest.approx(1.0) and c.k == 5  # the same five classes, reordered
    assert 0.0 < c.cosine < 1.0


def test_topk_is_left_out_when_there_are_not_more_classes_than_k_and_for_integers():
    ref = np.random.default_rng(2).standard_normal((3, 4))
    c = check_output("y", ref, ref, ATOL, RTOL, topk=5)
    assert c.top1 == 1.0 and c.topk is None
    ints = np.array([[1, 2], [3, 4]], np.int64)
    ci = check_output("ids", ints, ints, 0.0, 0.0)
    assert ci.passed and ci.top1 is None


def test_min_cosine_and_min_top1_are_extra_gates():
    ref = np.array([[1.0, 0.0], [0.0, 1.0]])
    got = np.array([[1.0, 0.0], [1.0, 0.9]])
    gated = check_output("y", got, ref, 10.0, 0.0, min_cosine=0.99)
    assert not gated.passed and gated.allclose  # within tolerance, below the cosine floor
    assert not check_output("y", got, ref, 10.0, 0.0, min_top1=0.9).passed
    assert check_output("y", got, ref, 10.0, 0.0).passed


def test_empty_outputs_pass():
    assert check_output("y", np.zeros((0, 4)), np.zeros((0, 4)), ATOL, RTOL).passed


def test_compare_outputs_keeps_the_build_report_keys_and_summarize_names_failures():
    ref = {"a": np.zeros(3), "b": np.ones(2)}
    got = {"a": np.zeros(3), "b": np.array([1.0, 2.0])}
    report = compare_outputs(got, ref, ATOL, RTOL, rule="elementwise")
    assert report["a"]["passed"] and not report["b"]["passed"]
    assert {"passed", "max_abs", "max_rel"} <= set(report["b"])
    text = summarize({"cases": [{"shapes": {"x": [2]}, "outputs": report}]})
    assert "output 'b'" in text and "max abs error 1" in text
