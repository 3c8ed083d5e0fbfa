"""Verification judges float16/bfloat16 outputs at their type's tolerance, float32 ones never
more loosely than asked (enginekit.verify.dtype_tolerance)."""

from __future__ import annotations

import numpy as np

from enginekit.config import default_tolerance
from enginekit.verify import check_outputs, dtype_tolerance

FP32 = default_tolerance("fp32")


def _one_ulp_apart(dtype) -> tuple[np.ndarray, np.ndarray]:
    ref = np.linspace(0.5, 1.0, 64).astype(dtype)
    got = np.nextafter(ref, np.asarray(2, dtype))  # one rounding step up, everywhere
    return got, ref


def test_float16_output_one_ulp_off_passes_an_fp32_build():
    got, ref = _one_ulp_apart(np.float16)
    (check,) = check_outputs({"y": got}, {"y": ref}, FP32.atol, FP32.rtol, min_cosine=0.9999)
    assert check.passed, check
    assert check.bound == default_tolerance("fp16").atol + default_tolerance("fp16").rtol


def test_float32_output_keeps_the_tolerance_given():
    ref = np.linspace(0.5, 1.0, 64).astype(np.float32)
    got = ref * np.float32(1 + 1e-3)  # float16's rounding step, in a float32 output: a real error
    (check,) = check_outputs({"y": got}, {"y": ref}, FP32.atol, FP32.rtol, min_cosine=0.9999)
    assert not check.passed
    assert dtype_tolerance(np.float32, FP32.atol, FP32.rtol, "scaled", 0.9999) == (
        FP32.atol,
        FP32.rtol,
        0.9999,
    )


def test_a_looser_tolerance_asked_for_stays_looser_on_float16():
    atol, rtol, cos = dtype_tolerance(np.float16, 0.5, 0.5, "elementwise", 0.9)
    assert (atol, rtol, cos) == (0.5, 0.5, 0.9)
    fp16 = default_tolerance("fp16", "elementwise")
    assert dtype_tolerance(np.float16, 0.0, 0.0, "elementwise") == (fp16.atol, fp16.rtol, None)
