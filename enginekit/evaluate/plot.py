"""PNG plots of benchmark results (matplotlib, imported only here, drawing with Agg)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from enginekit.errors import UsageError

if TYPE_CHECKING:
    from enginekit.evaluate.report import BenchResult


def bench_plot(results: Sequence[BenchResult], path: str | os.PathLike) -> Path:
    """Write a PNG of throughput and p99 latency vs batch size, one line per engine.

    matplotlib (the ``test`` extra) is imported here, with its Agg canvas: no display needed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UsageError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax_t, ax_l = fig.subplots(1, 2)
    for r in results:
        ok = [b for b in r.results if b.latency_ms is not None]
        if not ok:
            continue
        xs = [b.batch for b in ok]
        low = [b.throughput - min(b.round_throughputs) for b in ok]
        high = [max(b.round_throughputs) - b.throughput for b in ok]
        ax_t.errorbar(
            xs, [b.throughput for b in ok], yerr=[low, high], marker="o", capsize=3, label=r.label
        )
        ax_l.plot(xs, [b.latency_ms.p99 for b in ok], marker="o", label=r.label)  # type: ignore[union-attr]
        for b in ok:
            if b.split:
                ax_t.annotate("split", (b.batch, b.throughput), fontsize=7)
    batches = sorted({b.batch for r in results for b in r.results if b.latency_ms is not None})
    for ax, ylabel in ((ax_t, "throughput (samples/s)"), (ax_l, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        if batches:
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if results:
            ax.legend(fontsize=8)
    host = results[0].host.get("cpu", "") if results else ""
    fig.suptitle(f"enginekit bench — {host}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png")
    return path
