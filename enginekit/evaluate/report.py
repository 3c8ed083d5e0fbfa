"""Terminal tables for compare, bench and auto reports (JSON is each report's ``to_json``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginekit.evaluate.bench import BenchResult
    from enginekit.evaluate.compare import CompareReport


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns sized to their widest cell; the last column is not padded."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def num(value: float | None, digits: int = 3) -> str:
    """A short number: 3 significant digits, '-' for None, 'inf'/'nan' as such."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}"


def shapes_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return " ".join(f"{k}:{'x'.join(map(str, v)) or 'scalar'}" for k, v in shapes.items())


def compare_table(report: CompareReport) -> str:
    """One row per entry and output (its worst input set); skipped and errored entries one row."""
    header = ["BACKEND", "STATUS", "OUTPUT", "MAX ABS", "MAX REL", "P99 ABS", "COSINE", "TOP-1",
              "ATOL/RTOL", "NOTE"]  # fmt: skip
    rows = []
    for b in report.backends:
        if b.status in ("skipped", "error"):
            rows.append([b.label, b.status.upper(), "-", "", "", "", "", "", "", b.reason])
            continue
        for name, o in b.worst().items():
            rows.append(
                [
                    b.label,
                    "PASS" if o.passed else "FAIL",
                    name,
                    num(o.max_abs),
                    num(o.max_rel),
                    num(o.p99_abs),
                    "-" if o.cosine is None else f"{o.cosine:.6f}",
                    "-" if o.top1 is None else f"{o.top1:.3f}",
                    f"{b.atol:g}/{b.rtol:g}",
                    o.error or (f"{o.mismatch:.2%} of elements outside" if not o.passed else ""),
                ]
            )
    counts = {
        s: sum(b.status == s for b in report.backends)
        for s in ("passed", "failed", "error", "skipped")
    }
    sets = ", ".join(shapes_text(s) for s in report.shapes)
    head = f"reference: {report.reference}; inputs: {report.inputs}, {len(report.shapes)} set(s): {sets}"
    gate = "PASSED" if report.passed else "FAILED"
    tail = f"gate: {gate} ({', '.join(f'{v} {k}' for k, v in counts.items())})"
    return "\n".join([head, table(header, rows), tail])


def bench_table(results: Sequence[BenchResult]) -> str:
    """One row per engine and batch size, then the host and the notes."""
    header = ["ENGINE", "BATCH", "P50 MS", "P90 MS", "P99 MS", "MAX MS", "SAMPLES/S", "SPREAD",
              "RUNS", "PEAK RSS MB", "NOTE"]  # fmt: skip
    rows = []
    for r in results:
        for b in r.results:
            if b.latency_ms is None:
                rows.append([r.label, str(b.batch), "", "", "", "", "", "", "0", "", b.error or ""])
                continue
            lat = b.latency_ms
            rows.append(
                [
                    r.label,
                    str(b.batch) + (" (split)" if b.split else ""),
                    f"{lat.p50:.4g}",
                    f"{lat.p90:.4g}",
                    f"{lat.p99:.4g}",
                    f"{lat.max:.4g}",
                    f"{b.throughput:.5g}",
                    "-" if b.spread is None else f"{b.spread:.0%}" + ("!" if not b.stable else ""),
                    str(b.runs),
                    num(b.peak_rss_mb, 5),
                    b.note,
                ]
            )
    lines = [table(header, rows)]
    if results:
        h = results[0].host
        lines.append(
            f"host: {h.get('cpu', '?')}, {h.get('cpus', '?')} CPUs, load {h.get('loadavg', '?')}; "
            f"rounds {results[0].settings.get('rounds')}; SPREAD = (max - min) / median of the "
            "rounds' throughput ('!' = unstable)"
        )
    return "\n".join(lines)


def auto_table(auto: Mapping[str, Any]) -> str:
    """The candidates of an ``--backend auto`` build and why the winner won."""
    header = ["CANDIDATE", "STATUS", "MAX ABS", "P50 MS", "P99 MS", "SAMPLES/S", "SPREAD", "NOTE"]
    rows = []
    for c in auto.get("candidates", []):
        b = c.get("bench") or {}
        lat = b.get("latency_ms") or {}
        spread = b.get("spread")
        rows.append(
            [
                c["label"] + (" *" if c["label"] == auto.get("winner") else ""),
                c["status"],
                num((c.get("verify") or {}).get("max_abs")),
                num(lat.get("p50"), 4),
                num(lat.get("p99"), 4),
                num(b.get("throughput"), 5),
                "-" if spread is None else f"{spread:.0%}",
                c.get("error") or b.get("note") or "",
            ]
        )
    return "\n".join([table(header, rows), f"winner: {auto.get('reason', '')}"])
