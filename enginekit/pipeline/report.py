"""The pipeline report: per entry accuracy and bench results, gates against limits and a
baseline report, the exit code, and a Markdown summary for the CI log.

Exit codes (also in :mod:`enginekit.cli`): 0 every entry built and every gate passed; 1 an
entry could not be built (or, with ``--strict``, its backend is unavailable here); 2 the build
file or the baseline is invalid; 3 a gate failed (accuracy, top-1 agreement, throughput
regression) or an engine failed its build-time verification.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from enginekit import target
from enginekit.files import atomic_write
from enginekit.pipeline.config import ConfigError, Entry, Gates, PipelineConfig
from enginekit.pipeline.locate import Located
from enginekit.pipeline.matrix import Outcome
from enginekit.version import __version__

SCHEMA = "enginekit.pipeline-report/1"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_GATE = 0, 1, 2, 3


# -- accuracy ------------------------------------------------------------------------------------


def _finite(value: Any) -> float:
    """A reported error as a float; None (non-finite in strict JSON) counts as infinite."""
    if value is None:
        return math.inf
    return float(value)


def accuracy(verify: Mapping[str, Any] | None) -> dict[str, Any]:
    """The numbers the accuracy gates read, from a build's verification report.

    Reads the fp32/fp16 report (``cases`` of per-output errors against ONNX Runtime CPU) and
    the int8 accuracy report (``outputs`` on real data, with top-1 agreement).

    Returns:
        ``{"measured", "passed", "max_abs_error", "top1_agreement", "reference", "data"}``.
    """
    if not verify:
        return {"measured": False, "passed": None, "max_abs_error": None, "top1_agreement": None}
    per_output: list[Mapping[str, Any]] = []
    for case in verify.get("cases", []):
        per_output.extend(case.get("outputs", {}).values())
    if isinstance(verify.get("outputs"), Mapping):
        per_output.extend(verify["outputs"].values())
    errors = [_finite(o.get("max_abs")) for o in per_output if "max_abs" in o or "error" in o]
    top1 = [
        float(o[k]) for o in per_output for k in ("top1_agreement", "top1") if o.get(k) is not None
    ]
    return {
        "measured": True,
        "passed": verify.get("passed"),
        "max_abs_error": max(errors) if errors else None,
        "top1_agreement": min(top1) if top1 else None,
        "reference": verify.get("reference"),
        "data": verify.get("data", "random inputs at each profile's min and max"),
    }


# -- gates ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GateResult:
    """One gate on one entry: passed True/False, or None when it could not be evaluated
    (no baseline, a new entry) — which does not fail the run."""

    gate: str
    limit: float | None
    value: float | None
    passed: bool | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _accuracy_gates(entry: Entry, acc: Mapping[str, Any], gates: Gates) -> list[GateResult]:
    out = []
    limit = gates.limit("max_abs_error", entry.precision)
    if limit is not None:
        value = acc.get("max_abs_error")
        if value is None:
            out.append(GateResult("max_abs_error", limit, None, False, _unmeasured(entry)))
        else:
            ok = value <= limit
            message = f"max abs error {value:.3g} {'<=' if ok else '>'} {limit:g}"
            out.append(GateResult("max_abs_error", limit, value, ok, message))
    limit = gates.limit("min_top1_agreement", entry.precision)
    if limit is not None:
        value = acc.get("top1_agreement")
        if value is None:
            why = (
                _unmeasured(entry)
                if not acc.get("measured")
                else "top-1 agreement not measured: no classifier-shaped output ([batch, "
                "classes]) in the verification report"
            )
            out.append(GateResult("min_top1_agreement", limit, None, False, why))
        else:
            ok = value >= limit
            message = f"top-1 agreement {value:.2%} {'>=' if ok else '<'} {limit:.2%}"
            out.append(GateResult("min_top1_agreement", limit, value, ok, message))
    return out


def _unmeasured(entry: Entry) -> str:
    if not entry.config.verify:
        return "not measured: the entry is built with verify = false"
    return "not measured: the build recorded no verification report"


def _throughputs(bench: Mapping[str, Any] | None) -> dict[int, float]:
    if not bench:
        return {}
    return {
        int(b["batch"]): float(b["throughput"])
        for b in bench.get("batches", [])
        if b.get("throughput") and not b.get("error")
    }


def throughput_gate(
    limit: float,
    bench: Mapping[str, Any] | None,
    base_entry: Mapping[str, Any] | None,
    baseline_found: bool,
) -> GateResult:
    """Throughput of each batch size against the baseline's; fails when any batch size lost
    more than ``limit`` (a fraction)."""
    gate = "max_throughput_regression"
    if not baseline_found:
        return GateResult(gate, limit, None, None, "not evaluated: no baseline report")
    if base_entry is None:
        return GateResult(gate, limit, None, None, "not evaluated: new entry, not in the baseline")
    now, before = _throughputs(bench), _throughputs(base_entry.get("bench"))
    common = sorted(set(now) & set(before))
    if not now:
        return GateResult(gate, limit, None, None, "not evaluated: not benchmarked in this run")
    if not common:
        return GateResult(gate, limit, None, None, "not evaluated: no batch size in common")
    changes = {b: now[b] / before[b] - 1.0 for b in common}
    worst_batch = min(changes, key=lambda b: changes[b])
    regression = max(0.0, -changes[worst_batch])
    ok = regression <= limit
    detail = ", ".join(
        f"batch {b}: {_rate(now[b])} vs {_rate(before[b])} ({changes[b]:+.1%})" for b in common
    )
    verdict = "within" if ok else "exceeds"
    return GateResult(
        gate, limit, regression, ok,
        f"throughput {regression:.1%} below baseline at batch {worst_batch}, {verdict} "
        f"{limit:.0%} ({detail})",
    )  # fmt: skip


# -- baseline ------------------------------------------------------------------------------------


def load_baseline(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """A previous run's report.json, or None when ``path`` is None or does not exist (a first
    run has no baseline).

    Raises:
        ConfigError: the file exists but is not a pipeline report.
    """
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(p, [Located((), None, f"baseline is not readable JSON: {exc}")]) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            p,
            [
                Located(
                    (),
                    None,
                    f"baseline is not an enginekit pipeline report (schema {SCHEMA}, found {found!r})",
                )
            ],
        )
    return data


# -- the report ----------------------------------------------------------------------------------


def _rate(samples_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if samples_per_s >= scale:
            return f"{samples_per_s / scale:.3g}{unit}/s"
    return f"{samples_per_s:.3g}/s"


def _entry_report(
    entry: Entry,
    outcome: Outcome,
    bench: Mapping[str, Any] | None,
    gates: Gates,
    baseline: Mapping[str, Any] | None,
) -> dict[str, Any]:
    manifest = outcome.manifest or {}
    acc = accuracy(outcome.verify)
    results: list[GateResult] = []
    if outcome.failure == "verification":
        results.append(
            GateResult("verification", None, acc.get("max_abs_error"), False, outcome.reason)
        )
    if outcome.status in ("built", "cached") or outcome.failure == "verification":
        results.extend(_accuracy_gates(entry, acc, gates))
    limit = gates.max_throughput_regression
    if limit is not None and outcome.status in ("built", "cached"):
        base_entries = {e["id"]: e for e in (baseline or {}).get("entries", [])}
        results.append(
            throughput_gate(limit, bench, base_entries.get(entry.id), baseline is not None)
        )
    failed = [g for g in results if g.passed is False]
    return {
        **entry.to_json(),
        "status": outcome.status,
        "reason": outcome.reason,
        "failure": outcome.failure,
        "cache": outcome.cache_note
        or {"cached": "hit", "built": "miss" if outcome.key else None}.get(outcome.status),
        "key": outcome.key,
        "artifact": outcome.artifact,
        "build_key": manifest.get("build_key"),
        "backend_version": (manifest.get("backend") or {}).get("version"),
        "build_s": (manifest.get("build") or {}).get("build_s"),
        "seconds": round(outcome.seconds, 4),
        "pid": outcome.pid,
        "accuracy": acc,
        "bench": bench,
        "gates": [g.to_json() for g in results],
        "passed": outcome.status in ("built", "cached") and not failed,
    }


def assemble(
    cfg: PipelineConfig,
    model: Mapping[str, Any],
    outcomes: Sequence[Outcome],
    bench: Mapping[str, Mapping[str, Any]],
    baseline: Mapping[str, Any] | None,
    baseline_path: str | None,
    timings: Mapping[str, float],
) -> dict[str, Any]:
    """The whole report (schema ``enginekit.pipeline-report/1``) with its exit code."""
    by_id = {o.id: o for o in outcomes}
    entries = [
        _entry_report(e, by_id[e.id], bench.get(e.id), cfg.gates, baseline) for e in cfg.entries
    ]
    regressions = [
        f"{e['id']}: {g['message']}" for e in entries for g in e["gates"] if g["passed"] is False
    ]
    errors = [e for e in entries if e["status"] == "failed" and e["failure"] == "error"]
    code = EXIT_FAILURE if errors else EXIT_GATE if regressions else EXIT_OK
    count = {
        s: sum(e["status"] == s for e in entries) for s in ("built", "cached", "skipped", "failed")
    }
    return {
        "schema": SCHEMA,
        "enginekit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"path": str(cfg.path), "sha256": cfg.sha256},
        "model": dict(model),
        "host": target.host(),
        "baseline": None
        if baseline_path is None
        else {
            "path": baseline_path,
            "found": baseline is not None,
            "created": (baseline or {}).get("created"),
            "cpu": ((baseline or {}).get("host") or {}).get("cpu"),
        },
        "gates": cfg.gates.to_json(),
        "warnings": [w.format(cfg.path) for w in cfg.warnings],
        "entries": entries,
        "summary": {"entries": len(entries), **count, "gates_failed": len(regressions)},
        "regressions": regressions,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "passed": code == EXIT_OK,
        "exit_code": code,
    }


# -- Markdown ------------------------------------------------------------------------------------


def _num(value: Any) -> str:
    return "–" if value is None else f"{value:.3g}"


def _bench_cell(bench: Mapping[str, Any] | None) -> str:
    rates = _throughputs(bench)
    if not rates:
        return "–"
    text = " / ".join(_rate(rates[b]) for b in sorted(rates))
    return text + " (reused)" if (bench or {}).get("reused") else text


def _vs_baseline(entry: Mapping[str, Any]) -> str:
    for g in entry["gates"]:
        if g["gate"] == "max_throughput_regression":
            if g["value"] is None:
                return "–"
            return f"−{g['value']:.1%}" if g["value"] > 0 else "no loss"
    return "–"


def _verdict(entry: Mapping[str, Any]) -> str:
    if entry["status"] == "skipped":
        return "skipped"
    if entry["status"] == "failed" and entry["failure"] == "error":
        return "❌ error"
    failed = [g["gate"] for g in entry["gates"] if g["passed"] is False]
    return "❌ " + ", ".join(failed) if failed else "✅"


def _notes(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a reader should know beyond the gates: an int8 entry slower than its fp32 twin,
    a cache entry that was corrupt and rebuilt."""
    notes = []
    rates = {
        (e["backend"], e.get("variant"), e["precision"]): _throughputs(e.get("bench"))
        for e in entries
    }
    for e in entries:
        if e["cache"] == "corrupt, rebuilt":
            notes.append(f"`{e['id']}`: its cached artifact failed its checksums; rebuilt")
        if e["precision"] != "int8":
            continue
        mine, fp32 = (
            rates.get((e["backend"], e.get("variant"), "int8")) or {},
            rates.get((e["backend"], e.get("variant"), "fp32")) or {},
        )
        for batch in sorted(set(mine) & set(fp32)):
            if fp32[batch] > 0 and mine[batch] < fp32[batch]:
                notes.append(
                    f"`{e['id']}` runs at {mine[batch] / fp32[batch]:.2f}x the fp32 entry's "
                    f"throughput at batch {batch}: int8 is slower here (no VNNI, or Q/DQ overhead "
                    "on a small model); keep fp32 on this host"
                )
                break
    return notes


def markdown(report: Mapping[str, Any]) -> str:
    """The report as a Markdown summary (for ``$GITHUB_STEP_SUMMARY`` and the CI log)."""
    s = report["summary"]
    head = {
        EXIT_OK: "✅ all gates passed",
        EXIT_GATE: f"❌ {s['gates_failed']} gate(s) failed",
        EXIT_FAILURE: "❌ build errors",
    }[report["exit_code"]]
    model = report["model"]
    base = report.get("baseline")
    base_text = (
        "no baseline"
        if base is None
        else f"baseline `{base['path']}`"
        + ("" if base["found"] else " (not found: regression gate not evaluated)")
    )
    sizes = sorted(
        {b["batch"] for e in report["entries"] for b in (e.get("bench") or {}).get("batches", [])}
    )
    lines = [
        f"## enginekit build: {head}",
        "",
        f"model `{model.get('name')}` (sha256 `{str(model.get('sha256'))[:12]}`) · "
        f"{s['entries']} entries: {s['built']} built, {s['cached']} cached, {s['skipped']} "
        f"skipped, {s['failed']} failed · {base_text}",
        "",
        "| entry | status | cache | max abs error | top-1 | throughput"
        + (f" (batch {' / '.join(map(str, sizes))})" if sizes else "")
        + " | vs baseline | gates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in report["entries"]:
        acc = e["accuracy"]
        top1 = acc.get("top1_agreement")
        lines.append(
            f"| `{e['id']}` | {e['status']} | {e['cache'] or '–'} | {_num(acc.get('max_abs_error'))} "
            f"| {'–' if top1 is None else f'{top1:.2%}'} | {_bench_cell(e.get('bench'))} "
            f"| {_vs_baseline(e)} | {_verdict(e)} |"
        )
    failed = [(e["id"], g) for e in report["entries"] for g in e["gates"] if g["passed"] is False]
    slower = [(i, g) for i, g in failed if g["gate"] == "max_throughput_regression"]
    accuracy = [(i, g) for i, g in failed if g["gate"] != "max_throughput_regression"]
    if accuracy:
        lines += ["", "### Accuracy gates failed", ""]
        lines += [f"- **{i}** ({g['gate']}): {g['message']}" for i, g in accuracy]
    if slower:
        lines += ["", "### Throughput regressions", ""]
        lines += [f"- **{i}**: {g['message']}" for i, g in slower]
    notes = _notes(report["entries"])
    if notes:
        lines += ["", "### Notes", ""] + [f"- {n}" for n in notes]
    problems = [
        e for e in report["entries"] if e["status"] in ("skipped", "failed") and e["reason"]
    ]
    if problems:
        lines += ["", "### Skipped and failed", ""]
        lines += [f"- `{e['id']}` ({e['status']}): {e['reason']}" for e in problems]
    if report.get("warnings"):
        lines += ["", "### Warnings", ""] + [f"- {w}" for w in report["warnings"]]
    t = report["timings"]
    lines += [
        "",
        f"<sub>enginekit {report['enginekit_version']} · build phase {t.get('build_s', 0):.2f} s"
        f" · bench {t.get('bench_s', 0):.2f} s · total {t.get('total_s', 0):.2f} s</sub>",
        "",
    ]
    return "\n".join(lines)


def strict_json(value: Any) -> Any:
    """Non-finite floats (an infinite error) become None: strict JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write(report: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; append the Markdown to
    ``$GITHUB_STEP_SUMMARY`` when that is set (GitHub Actions)."""
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    text = markdown(report)
    strict = json.dumps(strict_json(report), indent=2, default=str, allow_nan=False)
    for path, content in ((json_path, strict + "\n"), (md_path, text)):
        with atomic_write(path, "w") as f:
            f.write(content)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return json_path, md_path
