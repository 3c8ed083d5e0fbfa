"""Range observers, fed one batch at a time: running min/max and a histogram of |x|; and the
three ways to turn them into a symmetric threshold ``amax`` (MinMax, Entropy, Percentile).

The histogram keeps a fixed bin width while the range grows across batches (new bins are
appended, so earlier counts stay exact); when it would pass ``2 * bins`` bins, adjacent bins
are merged in pairs (width doubles, still exact). So a tensor's histogram always has between
``bins`` and ``2 * bins`` bins over ``[0, max|x|]``, whatever order the batches come in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from enginekit.errors import CalibrationError

METHODS = ("minmax", "entropy", "percentile")
DEFAULT_BINS = 2048
DEFAULT_PERCENTILE = 99.99
#: Quantized levels on one side of zero for symmetric int8 (TensorRT's entropy calibrator uses 128).
QUANT_LEVELS = 128
#: Entropy thresholds start here (fewer kept bins than quantized levels cannot be right).
START_BIN = 128
#: The entropy threshold never clips more than this percentage of a tensor's values: on a sparse
#: histogram (few values, or all far from zero) KL can favour a threshold clipping nearly all.
ENTROPY_MAX_CLIP = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class Histogram:
    """Counts of ``|x|`` in equal bins from 0: bin ``k`` holds ``k*width < |x| <= (k+1)*width``.

    Exact zeros are counted apart in ``zeros``: symmetric quantization represents them exactly,
    so they must not weigh on the entropy search (ReLU outputs are often half zeros).
    """

    counts: np.ndarray
    width: float
    zeros: int = 0

    @property
    def total(self) -> int:
        """Number of values observed, zeros included."""
        return int(self.counts.sum()) + self.zeros

    def to_json(self) -> dict[str, Any]:
        nonzero = np.flatnonzero(self.counts)
        end = int(nonzero[-1]) + 1 if nonzero.size else 0
        return {
            "width": float(self.width),
            "zeros": int(self.zeros),
            "bins": len(self.counts),
            "counts": [int(c) for c in self.counts[:end]],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Histogram:
        counts = np.zeros(int(data["bins"]), np.int64)
        given = np.asarray(data["counts"], np.int64)
        if given.ndim != 1 or len(given) > len(counts) or (given < 0).any():
            raise ValueError("histogram counts must be a list of at most 'bins' counts >= 0")
        counts[: len(given)] = given
        width = float(data["width"])
        if not (math.isfinite(width) and width >= 0):
            raise ValueError(f"histogram width {width} is not a finite number >= 0")
        return cls(counts, width, int(data["zeros"]))


class RangeObserver:
    """Running min, max and (optionally) histogram of one tensor over every batch it sees.

    Args:
        name: the tensor's name (for error messages).
        bins: histogram resolution (between ``bins`` and ``2*bins`` bins over the range).
        histogram: keep the histogram (Entropy and Percentile need it; MinMax does not).
    """

    def __init__(self, name: str, bins: int = DEFAULT_BINS, histogram: bool = True) -> None:
        if bins < START_BIN:
            raise CalibrationError(f"histogram bins={bins}: need at least {START_BIN}")
        self.name = name
        self.bins = bins
        self.min = math.inf
        self.max = -math.inf
        self.count = 0
        self._keep = histogram
        self._counts = np.zeros(0, np.int64)
        self._width = 0.0
        self._zeros = 0

    def update(self, array: np.ndarray) -> None:
        """Add one batch's values of the tensor."""
        x = np.asarray(array)
        if x.size == 0:
            return
        x = x.reshape(-1)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        lo, hi = float(x.min()), float(x.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CalibrationError(
                f"tensor {self.name!r} holds NaN or Inf on this calibration batch; check the "
                "data (normalized as in training?) and the model in float32 first"
            )
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.count += x.size
        if self._keep:
            self._add(np.abs(x))

    def _add(self, a: np.ndarray) -> None:
        top = float(a.max())
        if top == 0.0:
            self._zeros += a.size
            return
        if self._width == 0.0:
            self._width = top / self.bins
            self._counts = np.zeros(self.bins, np.int64)
        needed = max(1, math.ceil(top / self._width))
        while needed > 2 * self.bins:
            self._merge_pairs()
            needed = max(1, math.ceil(top / self._width))
        n = max(needed, len(self._counts))
        if n > len(self._counts):
            self._counts = np.concatenate([self._counts, np.zeros(n - len(self._counts), np.int64)])
        # In place on the |x| copy: bin k+1 holds (k*w, (k+1)*w], slot 0 the exact zeros; values
        # within rounding of the top edge go to the last bin.
        np.multiply(a, np.float32(1.0 / self._width), out=a)
        np.ceil(a, out=a)
        np.minimum(a, np.float32(n), out=a)
        slots = np.bincount(a.astype(np.intp), minlength=n + 1)
        self._zeros += int(slots[0])
        self._counts += slots[1:]

    def _merge_pairs(self) -> None:
        counts = self._counts
        if len(counts) % 2:
            counts = np.append(counts, 0)
        self._counts = counts.reshape(-1, 2).sum(axis=1)
        self._width *= 2

    @property
    def amax(self) -> float:
        """max(|min|, |max|) seen so far (0 before any data)."""
        return 0.0 if self.count == 0 else max(abs(self.min), abs(self.max))

    def histogram(self) -> Histogram | None:
        """A snapshot of the |x| histogram, or None when it is not kept."""
        if not self._keep:
            return None
        return Histogram(self._counts.copy(), self._width, self._zeros)


def minmax_amax(lo: float, hi: float) -> float:
    """MinMax threshold: the largest magnitude seen, so nothing is ever clipped."""
    return max(abs(lo), abs(hi))


def entropy_amax(hist: Histogram, levels: int = QUANT_LEVELS, start_bin: int = START_BIN) -> float:
    """Entropy (KL-divergence) threshold, as TensorRT's entropy calibrator searches it.

    For each candidate threshold ``i`` (in bins): the reference distribution P is the first ``i``
    bins with every count beyond them added to bin ``i-1`` (clipping); the candidate Q is those
    ``i`` bins merged into ``levels`` quantized levels (bin ``k`` into level ``k*levels // i``)
    and spread back evenly over the bins that were non-empty. The threshold minimizing
    KL(P || Q) wins; ties go to the larger threshold.

    Every candidate is scored at once from prefix sums (a candidate costs O(levels), not O(i)),
    so the search over all ``i`` takes milliseconds.

    Returns:
        the threshold ``i * width``; the whole range when it has fewer than ``start_bin`` bins.
    """
    counts = hist.counts.astype(np.float64)
    nonzero = np.flatnonzero(counts)
    if nonzero.size == 0:
        return 0.0
    n = int(nonzero[-1]) + 1
    counts = counts[:n]
    if n <= start_bin:
        return n * hist.width
    total = counts.sum()
    xlogx = np.where(counts > 0, counts * np.log(np.where(counts > 0, counts, 1.0)), 0.0)
    csum = np.concatenate([[0.0], np.cumsum(counts)])  # csum[k] = sum(counts[:k])
    cocc = np.concatenate([[0.0], np.cumsum(counts > 0)])
    cxlogx = np.concatenate([[0.0], np.cumsum(xlogx)])
    i = np.arange(start_bin, n + 1, dtype=np.int64)
    # Level j covers bins [ceil(j*i/levels), ceil((j+1)*i/levels)).
    j = np.arange(levels + 1, dtype=np.int64)
    bounds = -((-j[None, :] * i[:, None]) // levels)
    level_sum = csum[bounds[:, 1:]] - csum[bounds[:, :-1]]
    level_bins = cocc[bounds[:, 1:]] - cocc[bounds[:, :-1]]
    kept = csum[i]
    clipped = total - kept
    last = counts[i - 1]
    # sum of x*log(x) over P's unnormalized masses: bins < i-1 as they are, bin i-1 + clipped.
    last_mass = last + clipped
    p_term = cxlogx[i - 1] + np.where(
        last_mass > 0, last_mass * np.log(np.maximum(last_mass, 1)), 0
    )
    # sum of x*log(q) over the same masses, q = level_sum / (level_bins * kept) on occupied bins.
    with np.errstate(divide="ignore", invalid="ignore"):
        per_level = np.where(
            level_sum > 0,
            level_sum * np.log(level_sum / (np.maximum(level_bins, 1) * kept[:, None])),
            0.0,
        )
        q_last = level_sum[:, -1] / (np.maximum(level_bins[:, -1], 1) * kept)
    # Clipped mass lands on bin i-1; if that bin was empty Q is 0 there: a bad candidate.
    log_q_last = np.where(last > 0, np.log(np.where(last > 0, q_last, 1.0)), math.log(1e-12))
    q_term = per_level.sum(axis=1) + clipped * log_q_last
    kl = (p_term - q_term) / total - math.log(total)
    # No kept mass (a tensor far from zero): Q is undefined there, never a candidate.
    kl = np.where(kept > 0, kl, np.inf)
    best = len(kl) - 1 - int(np.argmin(kl[::-1]))
    return int(i[best]) * hist.width


def percentile_amax(hist: Histogram, percentile: float = DEFAULT_PERCENTILE) -> float:
    """Percentile threshold: the upper edge of the bin where the CDF of |x| (zeros included)
    reaches ``percentile`` percent."""
    if not 0 < percentile <= 100:
        raise CalibrationError(f"percentile={percentile}: expected a number in (0, 100]")
    total = hist.total
    if total == 0 or not hist.counts.any():
        return 0.0
    target = percentile / 100.0 * total
    cdf = hist.zeros + np.cumsum(hist.counts)
    index = int(np.searchsorted(cdf, target - 1e-9 * total, side="left"))
    index = min(index, len(hist.counts) - 1)
    return (index + 1) * hist.width


def threshold(
    method: str,
    lo: float,
    hi: float,
    hist: Histogram | None,
    percentile: float = DEFAULT_PERCENTILE,
) -> float:
    """The method's amax for one tensor, never above the largest magnitude actually seen."""
    seen = minmax_amax(lo, hi)
    if method == "minmax":
        return seen
    if hist is None:
        raise CalibrationError(f"method {method!r} needs histograms; this table has none")
    if method == "entropy":
        amax = max(entropy_amax(hist), percentile_amax(hist, 100.0 - ENTROPY_MAX_CLIP))
    elif method == "percentile":
        amax = percentile_amax(hist, percentile)
    else:
        raise CalibrationError(f"calibration method {method!r} is not one of {', '.join(METHODS)}")
    return min(amax, seen)
