"""What a Batcher counts and times, as a dict and as Prometheus text (no dependency)."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

import numpy as np

OUTCOMES = ("completed", "rejected", "expired", "failed", "invalid", "cancelled", "closed")
QUANTILES = (0.5, 0.9, 0.99)
_WINDOW = 4096  # recent samples kept per timing


class Metrics:
    """Counters and recent timings; updated under the Batcher's lock."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.submitted = 0
        self.batches = 0
        self.prepared = 0  # batches collated by the helper while the engine ran another
        self.standby_batches = 0  # batches a standby thread ran
        self.batch_rows: Counter[int] = Counter()
        self.queue_wait: deque[float] = deque(maxlen=_WINDOW)
        self.engine: deque[float] = deque(maxlen=_WINDOW)
        self.latency: deque[float] = deque(maxlen=_WINDOW)
        self.sums = {"queue_wait": 0.0, "engine": 0.0, "latency": 0.0}
        self.counts = {"queue_wait": 0, "engine": 0, "latency": 0}
        self.reasons: Counter[str] = Counter()

    def add(self, name: str, seconds: float) -> None:
        getattr(self, name).append(seconds)
        self.sums[name] += seconds
        self.counts[name] += 1

    def add_many(self, name: str, seconds: list[float]) -> None:
        getattr(self, name).extend(seconds)
        self.sums[name] += sum(seconds)
        self.counts[name] += len(seconds)


def _quantiles(m: Metrics, name: str) -> dict[str, float]:
    """Percentiles of the recent samples, and count and sum since the start, in ms."""
    samples: deque[float] = getattr(m, name)
    totals = {"count": m.counts[name], "sum": m.sums[name] * 1e3}
    if not samples:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan, **totals}
    a = np.fromiter(samples, float, len(samples)) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(a.mean()),
        **totals,
    }


def snapshot(m: Metrics, **gauges: Any) -> dict[str, Any]:
    """The stats dict: gauges given by the Batcher, counts, histograms, percentiles in ms."""
    total_rows = sum(k * v for k, v in m.batch_rows.items())
    return {
        **gauges,
        "submitted": m.submitted,
        **{k: m.outcomes[k] for k in OUTCOMES},
        "batches": m.batches,
        "prepared_batches": m.prepared,
        "standby_batches": m.standby_batches,
        "mean_batch_size": total_rows / m.batches if m.batches else 0.0,
        "batch_size": dict(sorted(m.batch_rows.items())),
        "dispatch_reasons": dict(m.reasons),
        "queue_wait_ms": _quantiles(m, "queue_wait"),
        "engine_ms": _quantiles(m, "engine"),
        "latency_ms": _quantiles(m, "latency"),
    }


def _label(name: str, extra: str = "") -> str:
    escaped = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + f'batcher="{escaped}"' + (f",{extra}" if extra else "") + "}"


def _kv(key: str, value: object) -> str:
    return f'{key}="{value}"'


def prometheus(stats: dict[str, Any], name: str, max_batch: int) -> str:
    """Prometheus text exposition format (version 0.0.4) of a stats dict."""
    p = "enginekit_batcher_"
    lab = _label(name)
    lines = [
        f"# HELP {p}queue_depth Requests waiting for a batch.",
        f"# TYPE {p}queue_depth gauge",
        f"{p}queue_depth{lab} {stats['queue_depth']}",
        f"# HELP {p}queue_rows Rows waiting for a batch.",
        f"# TYPE {p}queue_rows gauge",
        f"{p}queue_rows{lab} {stats['queue_rows']}",
        f"# HELP {p}running_batches Batches in the engine now.",
        f"# TYPE {p}running_batches gauge",
        f"{p}running_batches{lab} {stats['running_batches']}",
        f"# HELP {p}submitted_total Requests submitted (accepted or not).",
        f"# TYPE {p}submitted_total counter",
        f"{p}submitted_total{lab} {stats['submitted']}",
        f"# HELP {p}requests_total Requests finished, by outcome.",
        f"# TYPE {p}requests_total counter",
    ]
    for outcome in OUTCOMES:
        lines.append(f"{p}requests_total{_label(name, _kv('outcome', outcome))} {stats[outcome]}")
    lines += [
        f"# HELP {p}batch_size Rows per batch sent to the engine.",
        f"# TYPE {p}batch_size histogram",
    ]
    bounds, b = [], 1
    while b < max_batch:
        bounds.append(b)
        b *= 2
    bounds.append(max_batch)
    sizes = stats["batch_size"]
    for bound in bounds:
        count = sum(v for k, v in sizes.items() if k <= bound)
        lines.append(f"{p}batch_size_bucket{_label(name, _kv('le', bound))} {count}")
    lines.append(f"{p}batch_size_bucket{_label(name, _kv('le', '+Inf'))} {stats['batches']}")
    lines.append(f"{p}batch_size_sum{lab} {sum(k * v for k, v in sizes.items())}")
    lines.append(f"{p}batch_size_count{lab} {stats['batches']}")
    for key, metric, text in (
        ("queue_wait", "queue_wait_seconds", "Time from submit to leaving the queue."),
        ("engine", "engine_seconds", "Engine time per batch."),
        ("latency", "latency_seconds", "Time from submit to result."),
    ):
        lines += [f"# HELP {p}{metric} {text}", f"# TYPE {p}{metric} summary"]
        q = stats[f"{key}_ms"]
        for quantile, col in zip(QUANTILES, ("p50", "p90", "p99")):
            value = q[col] / 1e3
            shown = "NaN" if math.isnan(value) else repr(value)
            lines.append(f"{p}{metric}{_label(name, _kv('quantile', quantile))} {shown}")
        lines.append(f"{p}{metric}_sum{lab} {q['sum'] / 1e3!r}")
        lines.append(f"{p}{metric}_count{lab} {q['count']}")
    return "\n".join(lines) + "\n"
