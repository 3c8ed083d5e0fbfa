"""What compare, bench and auto report: the result types (JSON through each one's ``to_json``)
and their terminal tables.

:class:`CompareReport` (with :class:`BackendCheck` and :class:`CaseCheck`) is what
:func:`enginekit.evaluate.compare.compare` returns; :class:`BenchResult` (with
:class:`BatchResult` and :class:`Latency`) what :func:`enginekit.evaluate.bench.bench` returns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from enginekit.verify import OutputCheck
from enginekit.version import __version__


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


def rate(value: float | None) -> str:
    """A throughput for people: ``193,050`` and ``1,234``, ``12.5`` and ``0.0312``; '-' for None."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def shapes_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return " ".join(f"{k}:{'x'.join(map(str, v)) or 'scalar'}" for k, v in shapes.items())


# -- compare ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CaseCheck:
    """One input set through one engine: the shapes and every output's check."""

    shapes: Mapping[str, tuple[int, ...]]
    outputs: tuple[OutputCheck, ...] = ()
    error: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and all(o.passed for o in self.outputs)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "passed": self.passed,
            "seconds": round(self.seconds, 6),
            "outputs": {o.name: o.to_json() for o in self.outputs},
        }
        if self.error:
            out["error"] = self.error
        return out


@dataclasses.dataclass(frozen=True)
class BackendCheck:
    """One compared entry: ``status`` is passed, failed (past the gate), skipped (cannot run
    here; ``reason`` says why) or error (failed to build or run; ``reason`` has the error)."""

    label: str
    backend: str
    status: str
    reason: str = ""
    version: str | None = None
    precision: str = "fp32"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    atol: float | None = None
    rtol: float | None = None
    rule: str = "scaled"
    min_cosine: float | None = None
    build_s: float | None = None
    cases: tuple[CaseCheck, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def worst(self) -> dict[str, OutputCheck]:
        """Per output, its check on the input set where its max abs error was largest."""
        out: dict[str, OutputCheck] = {}
        for case in self.cases:
            for o in case.outputs:
                have = out.get(o.name)
                if have is None or (have.passed, -have.max_abs) > (o.passed, -o.max_abs):
                    out[o.name] = o
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "backend": self.backend,
            "status": self.status,
            "reason": self.reason,
            "version": self.version,
            "precision": self.precision,
            "options": dict(self.options),
            "atol": self.atol,
            "rtol": self.rtol,
            "rule": self.rule,
            "min_cosine": self.min_cosine,
            "build_s": self.build_s,
            "worst": {k: v.to_json() for k, v in self.worst().items()},
            "cases": [c.to_json() for c in self.cases],
        }


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """What :func:`~enginekit.evaluate.compare.compare` returns: every entry's check against one
    reference.

    ``passed`` is the CI gate: at least one entry ran and none failed or errored (skipped
    entries do not fail it unless ``require_all`` was given).
    """

    reference: str
    inputs: str
    shapes: tuple[Mapping[str, tuple[int, ...]], ...]
    backends: tuple[BackendCheck, ...]
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    host: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    created: str = ""

    @property
    def ran(self) -> tuple[BackendCheck, ...]:
        return tuple(b for b in self.backends if b.status != "skipped")

    @property
    def passed(self) -> bool:
        if self.settings.get("require_all") and any(b.status == "skipped" for b in self.backends):
            return False
        return bool(self.ran) and all(b.passed for b in self.ran)

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-safe dict (schema ``enginekit.compare/1``)."""
        return {
            "schema": "enginekit.compare/1",
            "passed": self.passed,
            "enginekit_version": __version__,
            "created": self.created,
            "model": dict(self.model),
            "reference": self.reference,
            "inputs": {
                "source": self.inputs,
                "cases": [{k: list(v) for k, v in s.items()} for s in self.shapes],
            },
            "settings": dict(self.settings),
            "host": dict(self.host),
            "backends": [b.to_json() for b in self.backends],
        }

    def table(self) -> str:
        """A fixed-width table for the terminal: one row per entry and output (worst case)."""
        return compare_table(self)


def compare_table(report: CompareReport) -> str:
    """One row per entry and output (its worst input set); skipped and errored entries one row."""
    header = ["BACKEND", "STATUS", "OUTPUT", "MAX ABS", "OF SCALE", "MAX REL", "P99 ABS", "COSINE",
              "TOP-1", "RULE ATOL/RTOL", "NOTE"]  # fmt: skip
    rows = []
    for b in report.backends:
        if b.status in ("skipped", "error"):
            rows.append([b.label, b.status.upper(), "-", "", "", "", "", "", "", "", b.reason])
            continue
        for name, o in b.worst().items():
            rows.append(
                [
                    b.label,
                    "PASS" if o.passed else "FAIL",
                    name,
                    num(o.max_abs),
                    num(o.scaled_error),
                    num(o.max_rel),
                    num(o.p99_abs),
                    "-" if o.cosine is None else f"{o.cosine:.6f}",
                    "-" if o.top1 is None else f"{o.top1:.3f}",
                    f"{b.rule} {b.atol:g}/{b.rtol:g}",
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


# -- bench -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Latency:
    """Latency percentiles of single ``infer`` calls, in milliseconds."""

    p50: float
    p90: float
    p99: float
    max: float
    min: float
    mean: float

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """One batch size of one engine.

    Attributes:
        batch: rows per ``infer`` call.
        shapes: the input shapes used.
        runs: timed calls, all rounds together.
        latency_ms: percentiles over every timed call (None when it could not run).
        throughput: samples per second, the median over rounds.
        round_throughputs: samples per second of each round.
        spread: (max - min) / median of the round throughputs (None with one round).
        stable: spread within the threshold (None with one round: cannot tell).
        split: the batch is larger than the engine's largest profile, so each call is split
            into several runs and re-joined (what Engine does, and what was measured).
        peak_rss_mb: peak resident memory of the process while this batch size ran.
        note: what the numbers mean beyond themselves (split, unstable, extra rounds).
        error: why this batch size could not run (e.g. below the profile's minimum).
        extra_rounds: rounds added to settle an unstable result (the numbers are the last
            ``rounds`` rounds').
    """

    batch: int
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    runs: int = 0
    latency_ms: Latency | None = None
    throughput: float = 0.0
    round_throughputs: tuple[float, ...] = ()
    spread: float | None = None
    stable: bool | None = None
    split: bool = False
    peak_rss_mb: float | None = None
    note: str = ""
    error: str | None = None
    extra_rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "runs": self.runs,
            "latency_ms": None if self.latency_ms is None else self.latency_ms.to_json(),
            "throughput": round(self.throughput, 3),
            "round_throughputs": [round(t, 3) for t in self.round_throughputs],
            "spread": None if self.spread is None else round(self.spread, 4),
            "stable": self.stable,
            "split": self.split,
            "peak_rss_mb": self.peak_rss_mb,
            "note": self.note,
            "error": self.error,
            "extra_rounds": self.extra_rounds,
        }


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """The benchmark of one engine: per batch size results plus where and how it was measured."""

    engine: Mapping[str, Any]
    results: tuple[BatchResult, ...]
    settings: Mapping[str, Any]
    host: Mapping[str, Any]
    versions: Mapping[str, str]
    peak_rss_mb: float | None
    created: str

    @property
    def label(self) -> str:
        return str(self.engine.get("label", "engine"))

    @property
    def stable(self) -> bool:
        """No batch size was flagged unstable."""
        return all(r.stable is not False for r in self.results)

    def result(self, batch: int) -> BatchResult:
        """The result for one batch size."""
        for r in self.results:
            if r.batch == batch:
                return r
        raise KeyError(f"batch {batch} was not benchmarked ({[r.batch for r in self.results]})")

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-safe dict (schema ``enginekit.bench/1``)."""
        return {
            "schema": "enginekit.bench/1",
            "enginekit_version": __version__,
            "created": self.created,
            "engine": dict(self.engine),
            "host": dict(self.host),
            "versions": dict(self.versions),
            "settings": dict(self.settings),
            "peak_rss_mb": self.peak_rss_mb,
            "stable": self.stable,
            "results": [r.to_json() for r in self.results],
        }

    def table(self) -> str:
        """A fixed-width table for the terminal."""
        return bench_table([self])


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
                    rate(b.throughput),
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
            f"{_rounds_text(results[0].settings)}; SPREAD = (max - min) / median of the "
            "rounds' throughput ('!' = unstable)"
        )
    return "\n".join(lines)


def _rounds_text(settings: Mapping[str, Any]) -> str:
    rounds = settings.get("rounds")
    cap = settings.get("stabilize_cap_s")
    if not cap:
        return f"rounds {rounds}"
    return (
        f"rounds {rounds} (each result the last {rounds}; unstable ones re-measured with "
        f"more rounds until stable or {cap:g} s more)"
    )


# -- auto ------------------------------------------------------------------------------------------


def auto_table(auto: Mapping[str, Any]) -> str:
    """The candidates of an ``--backend auto`` build and why the winner won."""
    header = ["CANDIDATE", "STATUS", "MAX ABS", "TOP-1", "P50 MS", "P99 MS", "SAMPLES/S", "SPREAD",
              "NOTE"]  # fmt: skip
    rows = []
    for c in auto.get("candidates", []):
        b = c.get("bench") or {}
        lat = b.get("latency_ms") or {}
        spread = b.get("spread")
        top1 = (c.get("agreement") or {}).get("top1")
        rows.append(
            [
                c["label"] + (" *" if c["label"] == auto.get("winner") else ""),
                c["status"],
                num((c.get("verify") or {}).get("max_abs")),
                "-" if top1 is None else f"{top1:.1%}",
                num(lat.get("p50"), 4),
                num(lat.get("p99"), 4),
                rate(b.get("throughput")),
                "-" if spread is None else f"{spread:.0%}",
                c.get("error") or b.get("note") or "",
            ]
        )
    left = auto.get("precisions_left_out") or {}
    notes = [f"not tried: {p} ({why})" for p, why in left.items()]
    if auto.get("bf16_float_part"):  # int8 with its float part in bf16 (choose.bf16_float_part)
        notes.append(f"int8 with a bf16 float part: {auto['bf16_float_part']}")
    return "\n".join([table(header, rows), *notes, f"winner: {auto.get('reason', '')}"])
