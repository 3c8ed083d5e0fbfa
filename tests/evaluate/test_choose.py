"""--backend auto: the faster of two verified candidates wins, a candidate that fails
verification never does, failures are recorded, and the manifest says why."""

from __future__ import annotations

import json

import numpy as np
import pytest
from compare_helpers import changed_weight, padded, run_cli, stdout_json, tiny_mlp

import enginekit as ek
from enginekit.evaluate.choose import default_candidates

SHAPES = {"x": [(1, 16), (8, 16), (16, 16)]}
SHAPES_TEXT = "x:1x16,8x16,16x16"
QUICK = {"bench_duration": 0.15, "bench_rounds": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("choose")
    mlp = tiny_mlp(d / "mlp.onnx")
    return {
        "mlp": mlp,
        "padded": padded(mlp, d / "padded.onnx"),  # same outputs, ~100x the work
        "broken": changed_weight(mlp, d / "broken.onnx"),
        "dir": d,
    }


def test_auto_picks_the_faster_of_two_verified_candidates(models, tmp_path):
    slow = ek.Candidate("onnxruntime", model=models["padded"], label="padded")
    fast = ek.Candidate("onnxruntime", label="plain")
    out = tmp_path / "best.ekit"
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, output=out, candidates=[slow, fast], **QUICK
    )
    auto = engine.manifest["auto"]
    engine.close()
    assert auto["winner"] == "plain"
    assert auto["objective"] == "latency" and auto["batch"] == 8  # the opt shape
    assert [c["status"] for c in auto["candidates"]] == ["passed", "passed"]
    p50 = {c["label"]: c["bench"]["latency_ms"]["p50"] for c in auto["candidates"]}
    assert p50["padded"] > p50["plain"]
    assert "plain has the lowest p50 latency at batch 8" in auto["reason"]
    reloaded = ek.load(out)  # the written artifact is whole, loads and records it all
    assert reloaded.manifest["auto"]["winner"] == "plain"
    assert reloaded.manifest["bench"]["results"][0]["batch"] == 8
    assert reloaded.manifest["verify"]["passed"]
    reloaded.close()


def test_auto_never_picks_a_candidate_that_fails_verification(models):
    slow = ek.Candidate("onnxruntime", model=models["padded"], label="padded")
    wrong = ek.Candidate("onnxruntime", model=models["broken"], label="broken")
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, candidates=[wrong, slow], **QUICK
    )
    auto = engine.manifest["auto"]
    assert auto["winner"] == "padded"
    broken = auto["candidates"][0]
    assert broken["status"] == "failed verification"
    assert broken["verify"]["passed"] is False and "output 'output'" in broken["error"]
    assert "bench" not in broken  # never benched, never ranked
    assert "the only candidate" in auto["reason"]
    x = {"x": __import__("numpy").ones((2, 16), "float32")}
    assert engine.infer(x)["output"].shape == (2, 10)  # the winner works without an output path
    engine.close()


def test_throughput_objective_benches_at_the_largest_batch(models):
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, objective="throughput",
        candidates=[("onnxruntime", {}), ("onnxruntime", {"optimization_level": "basic"})],
        **QUICK,
    )  # fmt: skip
    auto = engine.manifest["auto"]
    engine.close()
    assert auto["batch"] == 16 and auto["metric"] == "throughput (samples/s)"
    assert "highest throughput at batch 16" in auto["reason"]


def test_failed_builds_and_unavailable_candidates_are_recorded_not_fatal(models, absent_backend):
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES,
        candidates=[("onnxruntime", {"optimization_level": "fastest"}), "absent",
                    ek.Candidate("onnxruntime", precision="int8"), "onnxruntime"],
        **QUICK,
    )  # fmt: skip
    records = engine.manifest["auto"]["candidates"]
    engine.close()
    assert [r["status"] for r in records] == ["build error", "skipped", "skipped", "passed"]
    assert "optimization_level 'fastest'" in records[0]["error"]
    assert "absent runtime is not installed" in records[1]["error"]
    assert "int8 needs calibration data" in records[2]["error"]  # offered, but no data given


def test_no_passing_candidate_is_a_verification_error_with_every_result(models, absent_backend):
    wrong = ek.Candidate("onnxruntime", model=models["broken"], label="broken")
    with pytest.raises(ek.VerificationError, match="broken: failed verification") as info:
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, candidates=[wrong], **QUICK)
    assert info.value.report["auto"]["candidates"][0]["label"] == "broken"
    with pytest.raises(ek.BuildError, match="no candidate could be built"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, candidates=["absent"])
    with pytest.raises(ek.UsageError, match="did you mean 'onnxruntime'"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, candidates=["onnxruntim"])


def test_auto_builds_int8_candidates_with_the_calibration_data_given(models, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((64, 16)).astype(np.float32))
    proc = run_cli(
        "build", models["mlp"], "--backend", "auto", "--shapes", SHAPES_TEXT,
        "--candidate", "onnxruntime", "--candidate", "onnxruntime", "precision=int8",
        "--calib-data", tmp_path / "calib.npz", "--bench-duration", "0.15",
        "-o", tmp_path / "best.ekit", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = stdout_json(proc)["auto"]["candidates"]
    assert [(r["precision"], r["status"]) for r in records] == [
        ("fp32", "passed"),
        ("int8", "passed"),
    ]


def test_bad_auto_requests_are_usage_errors(models):
    with pytest.raises(ek.UsageError, match="objective"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, objective="fastest")
    with pytest.raises(ek.UsageError, match="verifies every candidate"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, verify=False)


def test_default_candidates_cover_every_backend_and_precision_with_known_options():
    found = default_candidates(["fp32", "int8"], {"intra_op_threads": 1, "nonsense": 2})
    names = ek.available_backends()
    assert len(found) == 2 * len(names)
    ort = [(c, dropped) for c, dropped in found if c.backend == "onnxruntime"]
    assert [c.precision for c, _ in ort] == ["fp32", "int8"]
    assert ort[0][0].options == {"intra_op_threads": 1} and ort[0][1] == ["nonsense"]


def test_cli_build_auto_with_candidates_and_exit_codes(models, tmp_path):
    out = tmp_path / "best.ekit"
    proc = run_cli(
        "build", models["mlp"], "--backend", "auto", "--shapes", SHAPES_TEXT, "-o", out,
        "--candidate", "onnxruntime", "optimization_level=disable", "intra_op_threads=1",
        "--candidate", "onnxruntime", f"model={models['padded']}", "label=padded",
        "--precisions", "fp32", "--bench-duration", "0.15", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    manifest = stdout_json(proc)
    labels = [c["label"] for c in manifest["auto"]["candidates"]]
    assert labels == ["onnxruntime[optimization_level=disable, intra_op_threads=1]", "padded"]
    assert manifest["auto"]["winner"] == labels[0]
    assert json.loads(json.dumps(manifest["auto"]))  # JSON-safe

    failed = run_cli(
        "build", models["mlp"], "--backend", "auto", "--shapes", SHAPES_TEXT, "-o", out,
        "--candidate", "onnxruntime", f"model={models['broken']}", "--bench-duration", "0.1",
    )  # fmt: skip
    assert failed.returncode == 3 and "failed verification" in failed.stderr

    misuse = run_cli("build", models["mlp"], "--objective", "latency", "-o", out)
    assert misuse.returncode == 2 and "only apply with --backend auto" in misuse.stderr


def test_auto_tries_every_host_precision_with_calibration_data_and_records_why(models, monkeypatch):
    from enginekit import target

    monkeypatch.setattr(target, "cpu_flags", lambda: frozenset({"avx2"}))  # no bf16 here
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, backends=["onnxruntime"], calib_data=x,
        **QUICK,
    )  # fmt: skip
    auto = engine.manifest["auto"]
    engine.close()
    assert auto["precisions"] == ["fp32", "int8"]
    assert "no bf16 instructions" in auto["precisions_left_out"]["bf16"]
    assert [(c["backend"], c["precision"]) for c in auto["candidates"]] == [
        ("onnxruntime", "fp32"),
        ("onnxruntime", "int8"),
    ]
    assert auto["agreement_data"].startswith("6 calibration rows held out")
    assert auto["min_top1_agreement"] == 0.99
    for c in auto["candidates"]:
        assert c["status"] == "passed" and 0.0 <= c["agreement"]["top1"] <= 1.0
        assert c["verdict"].startswith("won: " if c["label"] == auto["winner"] else "lost: slower")


def test_a_reduced_precision_below_the_top1_floor_is_never_chosen(models, monkeypatch):
    from enginekit.evaluate import agreement

    real = agreement.measure

    def int8_disagrees(engine, feeds, ref):
        found = real(engine, feeds, ref)
        if engine.manifest["precision"] == "int8":
            return agreement.Agreement(0.5, found.cosine, found.rows)
        return found

    monkeypatch.setattr(agreement, "measure", int8_disagrees)
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, precisions=["int8", "fp32"],
        backends="onnxruntime", calib_data=x, **QUICK,
    )  # fmt: skip
    auto = engine.manifest["auto"]
    engine.close()
    int8, fp32 = auto["candidates"]
    assert int8["status"] == "failed accuracy gate" and "50.00%" in int8["error"]
    assert int8["verdict"].startswith("lost: failed accuracy gate") and "bench" not in int8
    assert auto["winner"] == fp32["label"] == "onnxruntime"
    with pytest.raises(ek.VerificationError, match="failed accuracy gate"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, precisions=["int8"],
                 backends=["onnxruntime"], calib_data=x, **QUICK)  # fmt: skip


def test_backends_restrict_the_candidates_and_a_typo_names_the_closest(models):
    found = default_candidates(["fp32"], backends=["onnxruntime"])
    assert [c.backend for c, _ in found] == ["onnxruntime"]
    with pytest.raises(ek.UsageError, match="did you mean 'openvino'"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, backends=["openvin"])
    with pytest.raises(ek.UsageError, match="not both"):
        ek.build(models["mlp"], backend="auto", shapes=SHAPES, backends=["onnxruntime"],
                 candidates=["onnxruntime"])  # fmt: skip


def test_cli_build_auto_backends_flag_and_its_typo(models, tmp_path):
    out = tmp_path / "best.ekit"
    proc = run_cli(
        "build", models["mlp"], "--backend", "auto", "--shapes", SHAPES_TEXT, "-o", out,
        "--backends", "onnxruntime", "--bench-duration", "0.1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "TOP-1" in proc.stdout and "winner: onnxruntime" in proc.stdout
    typo = run_cli(
        "build", models["mlp"], "--backend", "auto", "--shapes", SHAPES_TEXT, "-o", out,
        "--backends", "onnxrumtime",
    )  # fmt: skip
    assert typo.returncode == 2 and "did you mean 'onnxruntime'" in typo.stderr
    misuse = run_cli("build", models["mlp"], "--backends", "onnxruntime", "-o", out)
    assert misuse.returncode == 2 and "--backends only apply with --backend auto" in misuse.stderr


def test_an_accuracy_target_reaches_every_int8_candidate_and_sets_the_floor(models):
    x = np.random.default_rng(0).standard_normal((80, 16)).astype(np.float32)
    target = ek.AccuracyTarget(min_top1_agreement=0.5, max_plans=2)
    engine = ek.build(
        models["mlp"], backend="auto", shapes=SHAPES, backends=["onnxruntime"],
        precisions=["int8"], calib_data=x, accuracy_target=target, **QUICK,
    )  # fmt: skip
    auto, calibration = engine.manifest["auto"], engine.manifest["calibration"]
    engine.close()
    assert auto["min_top1_agreement"] == 0.5  # the target's limit is the gate's floor
    assert "accuracy_search" in calibration  # build's int8 stage searched for the target
