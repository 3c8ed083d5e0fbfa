"""Observers against hand-computed values on synthetic distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from enginekit.calibration.observers import (
    Histogram,
    RangeObserver,
    entropy_amax,
    percentile_amax,
    threshold,
)
from enginekit.errors import CalibrationError


def _observe(data: np.ndarray, chunks: int = 1, bins: int = 2048) -> RangeObserver:
    obs = RangeObserver("t", bins)
    for part in np.array_split(data, chunks):
        obs.update(part)
    return obs


def _entropy_by_loops(counts: np.ndarray, width: float, levels: int = 128, start: int = 128):
    """The entropy search written out plainly, one candidate and one bin at a time."""
    counts = counts[: np.flatnonzero(counts)[-1] + 1].astype(float)
    n = len(counts)
    best, best_kl = n, math.inf
    for i in range(start, n + 1):
        p = list(counts[:i])
        p[-1] += counts[i:].sum()
        level_sum = [0.0] * levels
        level_bins = [0] * levels
        for k in range(i):
            j = k * levels // i
            level_sum[j] += counts[k]
            level_bins[j] += counts[k] > 0
        q = [
            level_sum[k * levels // i] / level_bins[k * levels // i] if counts[k] else 0.0
            for k in range(i)
        ]
        sp, sq = sum(p), sum(q)
        kl = 0.0
        for pk, qk in zip(p, q):
            if pk > 0:
                kl += pk / sp * math.log((pk / sp) / max(qk / sq, 1e-12))
        if kl <= best_kl + 1e-12:
            best, best_kl = i, min(kl, best_kl)
    return best * width


@pytest.fixture(scope="module")
def gaussian_with_outliers() -> np.ndarray:
    """999,000 N(0, 1) values and 1,000 outliers evenly spread over [8, 50] (0.1%)."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal(999_000).astype(np.float32)
    outliers = np.linspace(8, 50, 1000, dtype=np.float32) * rng.choice([-1, 1], 1000)
    data = np.concatenate([g, outliers.astype(np.float32)])
    return rng.permutation(data)


def test_minmax_is_the_largest_magnitude_seen():
    obs = _observe(np.array([-3.0, 0.5, 2.0], np.float32))
    obs.update(np.array([-1.0, 2.5], np.float32))
    assert (obs.min, obs.max, obs.amax) == (-3.0, 2.5, 3.0)
    assert threshold("minmax", obs.min, obs.max, None) == 3.0


def test_histogram_counts_each_value_in_its_bin_and_zeros_apart():
    obs = RangeObserver("t", bins=128)
    obs.update(np.array([0.0, 0.0, 1.0, -0.5, 0.25], np.float32))  # width = 1/128
    h = obs.histogram()
    assert h.zeros == 2 and h.total == 5 and h.width == pytest.approx(1 / 128)
    assert h.counts[127] == 1 and h.counts[63] == 1 and h.counts[31] == 1  # (k*w, (k+1)*w]


def test_percentile_on_a_known_distribution():
    # |x| = 1..10000 (x 1e-4): the p-th percentile is p/100 up to one bin (1/2048).
    x = (np.arange(1, 10001) * 1e-4).astype(np.float32)
    h = _observe(x * np.where(np.arange(10000) % 2, 1, -1)).histogram()
    w = h.width
    assert percentile_amax(h, 50.0) == pytest.approx(0.5, abs=w)
    assert percentile_amax(h, 99.0) == pytest.approx(0.99, abs=w)
    assert percentile_amax(h, 100.0) == pytest.approx(1.0, abs=w)


def test_entropy_keeps_the_whole_range_of_a_uniform_distribution():
    x = np.random.default_rng(0).uniform(-2, 2, 200_000).astype(np.float32)
    obs = _observe(x, chunks=4)
    amax = threshold("entropy", obs.min, obs.max, obs.histogram())
    assert amax == pytest.approx(2.0, rel=0.01)


def test_entropy_matches_a_plain_loop_implementation():
    rng = np.random.default_rng(3)
    data = np.concatenate([rng.laplace(0, 1, 20_000), rng.uniform(5, 9, 40)]).astype(np.float32)
    h = _observe(data, bins=256).histogram()
    assert entropy_amax(h) == pytest.approx(_entropy_by_loops(h.counts, h.width))


def test_entropy_clips_outliers_minmax_keeps_percentile_in_between(gaussian_with_outliers):
    obs = _observe(gaussian_with_outliers, chunks=8)
    hist = obs.histogram()
    minmax = threshold("minmax", obs.min, obs.max, hist)
    entropy = threshold("entropy", obs.min, obs.max, hist)
    pct = threshold("percentile", obs.min, obs.max, hist, 99.99)
    assert minmax == pytest.approx(50.0)
    # 0.01% of 1e6 values = the 100 largest, all outliers: the top 100 of linspace(8, 50, 1000).
    assert pct == pytest.approx(50 - 100 * 42 / 999, abs=2 * hist.width)
    # KL keeps the Gaussian body (|x| < ~5) and clips every outlier (|x| >= 8).
    assert 3.0 < entropy < 8.0
    assert entropy < pct < minmax


def test_histograms_merge_exactly_when_the_range_grows_across_batches():
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(5000).astype(np.float32) * s for s in (0.01, 0.3, 7.0, 90.0)]
    grown = RangeObserver("t", bins=256)
    for p in parts:  # every batch widens the range; the last one by ~13x
        grown.update(p)
    h = grown.histogram()
    assert h.total == 20_000 and 256 <= len(h.counts) <= 512
    assert h.width * len(h.counts) >= grown.amax > h.width * (len(h.counts) - 1)
    at_once = RangeObserver("t", bins=256)
    at_once.update(np.concatenate(parts))
    # Same data, one batch: percentiles agree within the coarser histogram's bin.
    for p in (50.0, 90.0, 99.0):
        assert percentile_amax(h, p) == pytest.approx(
            percentile_amax(at_once.histogram(), p), abs=2 * h.width
        )


def test_entropy_ignores_exact_zeros_percentile_counts_them():
    rng = np.random.default_rng(2)
    relu = np.maximum(rng.standard_normal(100_000), 0).astype(np.float32)  # half exact zeros
    h = _observe(relu).histogram()
    assert h.zeros == int((relu == 0).sum())
    body = _observe(relu[relu > 0]).histogram()
    assert entropy_amax(h) == pytest.approx(entropy_amax(body), rel=0.02)
    # The 75th percentile of relu(N(0,1)) is the 50th of |N(0,1)|: 0.674.
    assert percentile_amax(h, 75.0) == pytest.approx(0.674, abs=0.01)


def test_nan_in_a_tensor_is_an_error_naming_it():
    with pytest.raises(CalibrationError, match="'conv_out' holds NaN"):
        RangeObserver("conv_out").update(np.array([1.0, np.nan], np.float32))


def test_all_zero_tensor_gives_amax_zero():
    obs = _observe(np.zeros(100, np.float32))
    for method in ("minmax", "entropy", "percentile"):
        assert threshold(method, obs.min, obs.max, obs.histogram()) == 0.0


def test_histogram_json_round_trip_and_bad_counts():
    h = _observe(np.linspace(-1, 1, 1000, dtype=np.float32), bins=128).histogram()
    back = Histogram.from_json(h.to_json())
    assert np.array_equal(back.counts, h.counts) and back.width == h.width
    with pytest.raises(ValueError):
        Histogram.from_json({**h.to_json(), "counts": [-1]})


def test_bad_percentile_and_method_are_refused():
    h = _observe(np.ones(10, np.float32)).histogram()
    with pytest.raises(CalibrationError, match="percentile"):
        percentile_amax(h, 0.0)
    with pytest.raises(CalibrationError, match="not one of"):
        threshold("kl", 0.0, 1.0, h)


def test_entropy_never_clips_more_than_one_percent_of_a_sparse_tensor():
    # 500 values, all far from zero (a pooled feature): KL alone would clip nearly everything.
    x = np.random.default_rng(4).uniform(0.2, 1.7, 500).astype(np.float32)
    obs = _observe(x)
    amax = threshold("entropy", obs.min, obs.max, obs.histogram())
    assert (x > amax).mean() <= 0.01 + 1e-9
