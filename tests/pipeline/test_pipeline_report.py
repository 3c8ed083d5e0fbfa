"""Gates, baseline comparison, the Markdown summary and the exit codes a CI job sees."""

from __future__ import annotations

import json
import os

import pytest

from enginekit import backends
from enginekit.pipeline import ConfigError, run
from enginekit.pipeline.report import accuracy, load_baseline

from .helpers import BROKEN, MLP_SHAPES, cli

FAST_BENCH = "[bench]\nbatch_sizes = [1, 4]\nduration = 0.05\nrounds = 1\nwarmup = 0.0\n"
NO_BENCH = "[bench]\nenabled = false\n"


def config(project, engines: str, extra: str = "", name: str = "enginekit.toml"):
    return project.write(f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}{engines}\n{extra}', name)


def test_wrong_engine_fails_the_accuracy_gate(project, broken_backend):
    # Verification at build time is loosened so the artifact is written: the gate must catch it.
    path = config(
        project,
        '[[engine]]\nbackend = "broken"\natol = 100.0\n',
        "[gates]\nmax_abs_error = { fp32 = 1e-4 }\n" + NO_BENCH,
    )
    report = run(path, out=project.root / "dist")
    (entry,) = report["entries"]
    assert entry["status"] == "built" and not entry["passed"]
    (gate,) = entry["gates"]
    assert gate["gate"] == "max_abs_error" and gate["passed"] is False and gate["value"] > 1e-4
    assert report["exit_code"] == 3
    assert report["regressions"] == [f"mlp-broken-fp32: {gate['message']}"]
    md = (project.root / "dist" / "report.md").read_text()
    assert "### Accuracy gates failed" in md and "**mlp-broken-fp32** (max_abs_error)" in md
    assert "Regressions" not in md  # an accuracy failure is not a throughput regression


def test_engine_failing_build_verification_exits_3(project, broken_backend):
    path = config(project, '[[engine]]\nbackend = "broken"\n', NO_BENCH)
    report = run(path, out=project.root / "dist")
    (entry,) = report["entries"]
    assert (entry["status"], entry["failure"]) == ("failed", "verification")
    assert entry["accuracy"]["max_abs_error"] > 1e-4
    assert entry["gates"][0]["gate"] == "verification"
    assert report["exit_code"] == 3
    assert not (project.root / "dist" / "mlp-broken-fp32.ekit").exists()


def test_unmeasured_accuracy_fails_its_gate(project):
    path = config(
        project,
        '[[engine]]\nbackend = "onnxruntime"\nverify = false\n',
        "[gates]\nmax_abs_error = 1e-4\n" + NO_BENCH,
    )
    report = run(path, out=project.root / "dist")
    (gate,) = report["entries"][0]["gates"]
    assert gate["passed"] is False and "verify = false" in gate["message"]
    assert report["exit_code"] == 3


def scaled(report: dict, factor: float) -> dict:
    data = json.loads(json.dumps(report))
    for e in data["entries"]:
        for b in (e.get("bench") or {}).get("batches", []):
            b["throughput"] *= factor
    return data


def test_baseline_with_higher_throughput_fails_the_regression_gate(project):
    engines = '[[engine]]\nbackend = "onnxruntime"\n'
    path = config(project, engines, "[gates]\nmax_throughput_regression = 0.10\n" + FAST_BENCH)
    out, cache = project.root / "dist", project.root / "cache"
    first = run(path, out=out, cache=cache, baseline=project.root / "none.json")
    assert first["exit_code"] == 0
    gate = first["entries"][0]["gates"][0]
    assert gate["passed"] is None and "no baseline" in gate["message"]
    assert "not found" in (out / "report.md").read_text()
    faster = project.root / "faster.json"
    faster.write_text(json.dumps(scaled(first, 10.0)))
    slower = project.root / "slower.json"
    slower.write_text(json.dumps(scaled(first, 0.1)))

    regressed = run(path, out=out, cache=cache, baseline=faster)
    assert regressed["exit_code"] == 3
    (gate,) = regressed["entries"][0]["gates"]
    assert gate["passed"] is False and gate["value"] > 0.5
    assert "below baseline" in gate["message"] and "batch 4" in gate["message"]
    assert "mlp-onnxruntime-fp32" in regressed["regressions"][0]
    bench = regressed["entries"][0]["bench"]
    assert bench["tool"] == "enginekit.bench" and bench["remeasured"] is True

    improved = run(path, out=out, cache=cache, baseline=slower)
    assert improved["exit_code"] == 0
    assert improved["entries"][0]["gates"][0]["passed"] is True


def test_new_entry_is_not_compared_with_the_baseline(project):
    path = config(
        project,
        '[[engine]]\nbackend = "onnxruntime"\n',
        "[gates]\nmax_throughput_regression = 0.10\n" + FAST_BENCH,
    )
    base = project.root / "base.json"
    first = run(path, out=project.root / "dist")
    first["entries"][0]["id"] = "something-else"
    base.write_text(json.dumps(first))
    report = run(path, out=project.root / "dist", baseline=base)
    (gate,) = report["entries"][0]["gates"]
    assert gate["passed"] is None and "new entry" in gate["message"]
    assert report["exit_code"] == 0


def test_a_file_that_is_not_a_report_is_refused_as_baseline(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something"}')
    with pytest.raises(ConfigError, match="not an enginekit pipeline report"):
        load_baseline(bad)
    assert load_baseline(tmp_path / "missing.json") is None


def test_accuracy_reads_both_report_kinds():
    fp32 = {
        "passed": True,
        "cases": [{"outputs": {"y": {"max_abs": 1e-6, "passed": True, "top1": 1.0}}}],
    }
    int8 = {
        "passed": False,
        "kind": "accuracy",
        "outputs": {"y": {"max_abs": 0.2, "top1_agreement": 0.97}, "z": {"max_abs": 0.01}},
    }
    assert accuracy(fp32)["max_abs_error"] == 1e-6 and accuracy(fp32)["top1_agreement"] == 1.0
    assert accuracy(int8)["max_abs_error"] == 0.2 and accuracy(int8)["top1_agreement"] == 0.97
    nan = {"passed": False, "cases": [{"outputs": {"y": {"max_abs": None, "passed": False}}}]}
    assert accuracy(nan)["max_abs_error"] == float("inf")
    assert accuracy(None)["measured"] is False


def test_summary_is_appended_for_github_actions(project, monkeypatch):
    summary = project.root / "summary.md"
    summary.write_text("# earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    path = config(project, '[[engine]]\nbackend = "onnxruntime"\n', NO_BENCH)
    run(path, out=project.root / "dist")
    text = summary.read_text()
    assert text.startswith("# earlier step\n") and "## enginekit build: ✅" in text


# -- exit codes, as a CI job sees them -----------------------------------------------------------


def test_exit_0_when_every_entry_builds_and_passes(project):
    path = config(project, '[[engine]]\nbackend = "onnxruntime"\n', NO_BENCH)
    r = cli("build", "-c", str(path), "--out", "dist", "--cache", "cache", cwd=project.root)
    assert r.returncode == 0, r.stderr
    assert "## enginekit build: ✅ all gates passed" in r.stdout
    for name in ("mlp-onnxruntime-fp32.ekit", "report.json", "report.md"):
        assert (project.root / "dist" / name).is_file()


def test_exit_3_when_a_gate_fails(project):
    path = config(
        project,
        '[[engine]]\nbackend = "broken"\natol = 100.0\n',
        "[gates]\nmax_abs_error = 1e-4\n" + NO_BENCH,
    )
    r = cli("build", "-c", str(path), "-o", str(project.root / "dist"), prelude=BROKEN)
    assert r.returncode == 3, r.stderr
    assert "### Accuracy gates failed" in r.stdout


def test_exit_2_when_the_build_file_is_invalid(project):
    path = config(project, '[[engine]]\nbackend = "onnxruntime"\nprecision = "fp8"\n')
    r = cli("build", "-c", str(path), "-o", str(project.root / "dist"))
    assert r.returncode == 2
    assert f"{path}:7: engine[0].precision: 'fp8' is not one of" in r.stderr
    r = cli("build", "-c", str(path), "--backend", "tvm")
    assert r.returncode == 2 and "--backend" in r.stderr


def test_exit_1_when_an_entry_cannot_build_under_strict(project):
    if backends.availability("tensorrt").available:
        pytest.skip("TensorRT is available here")
    path = config(project, '[[engine]]\nbackend = "tensorrt"\n', NO_BENCH)
    env = {**os.environ, "GITHUB_ACTIONS": ""}
    r = cli("build", "-c", str(path), "-o", str(project.root / "dist"), "--strict", env=env)
    assert r.returncode == 1, r.stderr
    assert "not available here" in r.stdout


def test_an_int8_entry_slower_than_its_fp32_twin_gets_a_note():
    from enginekit.pipeline.report import markdown

    def entry(precision, rate):
        return {
            "id": f"m-onnxruntime-{precision}", "backend": "onnxruntime", "variant": None,
            "precision": precision, "status": "built", "cache": "miss", "accuracy": {},
            "gates": [], "reason": "", "bench": {"batches": [{"batch": 8, "throughput": rate}]},
        }  # fmt: skip

    report = {
        "summary": {"entries": 2, "built": 2, "cached": 0, "skipped": 0, "failed": 0,
                    "gates_failed": 0},
        "exit_code": 0, "model": {"name": "m", "sha256": "0" * 64}, "baseline": None,
        "entries": [entry("fp32", 2000.0), entry("int8", 1000.0)], "regressions": [],
        "warnings": [], "timings": {}, "enginekit_version": "0",
    }  # fmt: skip
    md = markdown(report)
    assert "### Notes" in md and "`m-onnxruntime-int8` runs at 0.50x the fp32 entry's" in md
