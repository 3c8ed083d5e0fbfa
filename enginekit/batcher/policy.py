"""When to send a batch: the engine's cost per batch size, learned online, against arrivals.

The engine's time for a batch of ``n`` rows is modelled as ``fixed + per_row * n``, fitted by
least squares with exponential forgetting over the batches it actually ran. Waiting for one more
request costs each of the ``n`` waiting requests the expected gap to the next arrival (plus the
extra row's engine time); it saves the newcomer a batch of its own, ``fixed``. So the batcher keeps
waiting only while ``n * (gap + per_row) < fixed`` and the next request is expected inside the
delay window — at low load a lone request goes at once instead of waiting out ``max_delay``
(BentoML's adaptive dispatcher reasons the same way; a fixed wait is what TorchServe users
complain about).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class CostModel:
    """Engine seconds for a batch of ``rows`` rows: ``fixed + per_row * rows``, fitted online."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._s = self._x = self._xx = self._y = self._xy = 0.0
        self.fixed = 0.0
        self.per_row = 0.0
        self.runs = 0

    def observe(self, rows: int, seconds: float) -> None:
        """Add one measured batch and refit."""
        d = self.decay
        self._s = self._s * d + 1.0
        self._x = self._x * d + rows
        self._xx = self._xx * d + rows * rows
        self._y = self._y * d + seconds
        self._xy = self._xy * d + rows * seconds
        self.runs += 1
        det = self._s * self._xx - self._x * self._x
        # With one batch size seen so far the slope is unknown: keep the last one.
        if det > 1e-9 * self._s * self._xx:
            self.per_row = max((self._s * self._xy - self._x * self._y) / det, 0.0)
        self.fixed = max((self._y - self.per_row * self._x) / self._s, 0.0)

    def predict(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


class ArrivalRate:
    """The expected gap to the next request: an average of recent gaps, or longer when quiet."""

    def __init__(self, weight: float = 0.05) -> None:
        self.weight = weight
        self.gap = math.inf
        self.last = -math.inf

    def observe(self, now: float) -> None:
        gap = now - self.last
        if math.isinf(self.gap):
            self.gap = gap if math.isfinite(gap) else math.inf
        else:
            self.gap += self.weight * (gap - self.gap)
        self.last = now

    def expected_gap(self, now: float) -> float:
        return max(self.gap, now - self.last)


class Decision(NamedTuple):
    """Whether to send the waiting rows now; if not, what would change that.

    ``need`` is the row count at which the answer flips to send (so a submit wakes the idle
    worker only once the group reaches it) and ``recheck_at`` the time at which it flips with
    no new arrival (the window's end, or the expected gap outgrowing the fixed cost).
    A NamedTuple, not a frozen dataclass: it is built for every batch decision, and a tuple is
    built in a third of the time.
    """

    send: bool
    reason: str  # "full", "window", "adaptive", "close", or "" while waiting
    recheck_at: float = math.inf
    need: int = 1


def decide(
    rows: int,
    max_rows: int,
    oldest: float,
    now: float,
    max_delay: float,
    rate: ArrivalRate | None,
    cost: CostModel,
) -> Decision:
    """Send ``rows`` waiting rows now, or wait for more? (``rate`` None: fixed window only.)"""
    if rows >= max_rows:
        return Decision(True, "full")
    window_end = oldest + max_delay
    if now >= window_end:
        return Decision(True, "window")
    if rate is None:
        return Decision(False, "", window_end, max_rows)
    gap = rate.expected_gap(now)
    step = gap + cost.per_row
    if gap > window_end - now or rows * step >= cost.fixed:
        return Decision(True, "adaptive")
    # Nothing arriving makes the expected gap grow: look again when either test would flip.
    flip = rate.last + max(cost.fixed / rows - cost.per_row, 0.0)
    half = (window_end + rate.last) / 2
    # Each arrival adds a row: the rows at which waiting stops paying at today's gap.
    need = max_rows if step <= 0 else min(max(math.ceil(cost.fixed / step), rows + 1), max_rows)
    return Decision(False, "", min(window_end, max(flip, now), max(half, now)), need)


def pow2_sizes(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including ``limit``."""
    sizes = [1]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    if limit > 1:
        sizes.append(limit)
    return tuple(sizes)


def take_size(rows: int, max_rows: int, preferred: Sequence[int], reason: str) -> int:
    """How many of ``rows`` waiting rows to send: the largest preferred size that fits (the rest
    keep waiting in their own windows), everything up to the maximum when none fits or when
    closing."""
    rows = min(rows, max_rows)
    if not preferred or reason == "close":
        return rows
    fits = [p for p in preferred if p <= rows]
    return fits[-1] if fits else rows
