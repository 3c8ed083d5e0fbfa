"""compare(): equal engines pass, a broken or NaN one fails, unavailable backends are skipped,
references (ORT, torch, callables), golden files, user data, and ``enginekit compare``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from compare_helpers import (
    changed_weight,
    mlp_weights,
    nan_weight,
    run_cli,
    stdout_json,
    tiny_mlp,
    torch_mlp,
)

import enginekit as ek

SHAPES = {"x": [(1, 16), (8, 16), (16, 16)]}
SHAPES_TEXT = "x:1x16,8x16,16x16"


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return tiny_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="module")
def built(mlp, tmp_path_factory):
    """Artifacts of the MLP, of a copy with one weight changed, and of a copy with a NaN weight."""
    d = tmp_path_factory.mktemp("compare")
    broken = changed_weight(mlp, d / "broken.onnx")
    nan = nan_weight(mlp, d / "nan.onnx")
    out = {}
    for name, src in (("ok", mlp), ("broken", broken), ("nan", nan)):
        ek.build(src, shapes=SHAPES, output=d / f"{name}.ekit", verify=False).close()
        out[name] = d / f"{name}.ekit"
    return out


def test_compare_passes_the_equal_engine_and_flags_the_broken_one(mlp, built):
    report = ek.compare(mlp, [str(built["ok"]), str(built["broken"]), "onnxruntime"])
    status = {b.label: b.status for b in report.backends}
    assert status == {
        str(built["ok"]): "passed",
        str(built["broken"]): "failed",
        "onnxruntime": "passed",
    }
    assert not report.passed
    # the random input sets are the engines' profile min, opt and max
    assert [s["x"] for s in report.shapes] == [(1, 16), (8, 16), (16, 16)]
    broken = report.backends[1].worst()["output"]
    assert broken.max_abs > 1e-3 and broken.mismatch > 0


def test_an_engine_that_outputs_nan_fails(mlp, built):
    check = ek.compare(mlp, [str(built["nan"])]).backends[0]
    assert check.status == "failed"
    assert "NaN" in check.worst()["output"].error


def test_an_unknown_backend_name_is_a_usage_error_with_the_closest_name(mlp):
    with pytest.raises(
        ek.UsageError, match="no backend named 'onnxruntim'; did you mean 'onnxruntime'"
    ):
        ek.compare(mlp, ["onnxruntime", "onnxruntim"], shapes=SHAPES)


def test_skipped_backends_alone_do_not_pass_and_require_all_fails_on_a_skip(mlp, absent_backend):
    assert not ek.compare(mlp, ["absent"], shapes=SHAPES).passed
    assert ek.compare(mlp, ["onnxruntime", "absent"], shapes=SHAPES).passed
    strict = ek.compare(mlp, ["onnxruntime", "absent"], shapes=SHAPES, require_all=True)
    assert not strict.passed


def test_a_candidate_that_fails_to_build_is_an_error_not_a_crash(mlp):
    bad = ek.Candidate("onnxruntime", {"optimization_level": "fastest"})
    report = ek.compare(
        mlp, [bad, ("onnxruntime", {"optimization_level": "disable"})], shapes=SHAPES
    )
    assert [b.status for b in report.backends] == ["error", "passed"]
    assert "optimization_level 'fastest'" in report.backends[0].reason
    assert not report.passed


def test_a_missing_artifact_path_is_a_usage_error(mlp, tmp_path):
    with pytest.raises(ek.UsageError, match="no such engine artifact"):
        ek.compare(mlp, [str(tmp_path / "missing.ekit")])


def test_torch_module_and_callable_references(mlp):
    pytest.importorskip("torch", reason="the reference is a torch module")
    report = ek.compare(mlp, ["onnxruntime"], shapes=SHAPES, reference=torch_mlp(mlp))
    assert report.passed and report.reference == "torch Sequential"

    w = mlp_weights(mlp)

    def off_by_one(x):
        return np.maximum(x @ w["w1"] + w["b1"], 0.0) @ w["w2"] + w["b2"] + 1.0

    assert not ek.compare(mlp, ["onnxruntime"], shapes=SHAPES, reference=off_by_one).passed
    with pytest.raises(ek.UsageError, match="returned 2 outputs"):
        ek.compare(mlp, ["onnxruntime"], shapes=SHAPES, reference=lambda x: (x, x))


def test_golden_file_round_trip_holds_engines_to_the_saved_outputs(mlp, built, tmp_path):
    golden = tmp_path / "golden.npz"
    first = ek.compare(mlp, [str(built["ok"])], save_golden_to=golden)
    assert first.passed and golden.is_file()
    again = ek.compare(None, [str(built["ok"]), str(built["broken"])], golden=golden)
    assert [b.status for b in again.backends] == ["passed", "failed"]
    assert again.inputs == "golden" and again.reference.startswith("golden golden.npz")
    assert [s["x"] for s in again.shapes] == [s["x"] for s in first.shapes]


def test_bad_golden_files_are_usage_errors(mlp, tmp_path):
    with pytest.raises(ek.UsageError, match="does not exist"):
        ek.compare(mlp, ["onnxruntime"], golden=tmp_path / "missing.npz")
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.zeros((1, 16), np.float32))
    with pytest.raises(ek.UsageError, match="not an enginekit golden file"):
        ek.compare(mlp, ["onnxruntime"], golden=plain)
    golden = tmp_path / "g.npz"
    ek.compare(mlp, ["onnxruntime"], shapes=SHAPES, save_golden_to=golden)
    other = tiny_mlp(tmp_path / "other.onnx", input="pixels")
    with pytest.raises(ek.UsageError, match="Make it from this model"):
        ek.compare(other, ["onnxruntime"], golden=golden)
    with pytest.raises(ek.UsageError, match="golden= alone"):
        ek.compare(mlp, ["onnxruntime"], golden=golden, data={"x": np.zeros((1, 16))})


def test_user_data_replaces_random_inputs_and_sets_the_build_shapes(mlp):
    rng = np.random.default_rng(3)
    data = [{"x": rng.standard_normal((n, 16)).astype(np.float32)} for n in (2, 5)]
    report = ek.compare(mlp, ["onnxruntime"], data=data)
    assert report.passed and report.inputs == "data"
    assert [s["x"] for s in report.shapes] == [(2, 16), (5, 16)]
    with pytest.raises(ek.UsageError, match="the model takes"):
        ek.compare(mlp, ["onnxruntime"], data={"pixels": data[0]["x"]})


def test_report_json_is_strict_json_with_every_entry(mlp, built, absent_backend):
    report = ek.compare(mlp, [str(built["nan"]), "absent"], shapes=SHAPES)
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["schema"] == "enginekit.compare/1" and data["passed"] is False
    first = data["backends"][0]
    assert first["status"] == "failed" and first["rule"] == "scaled"
    assert first["atol"] == 1e-6 and first["rtol"] == 1e-4 and first["min_cosine"] == 0.9999
    case = first["cases"][0]
    assert set(case["outputs"]["output"]) >= {"max_abs", "max_rel", "p99_abs", "cosine", "top1"}
    assert data["backends"][1]["status"] == "skipped"


def test_cli_compare_exit_codes_json_and_golden(mlp, built, tmp_path):
    ok = run_cli("compare", mlp, "--backends", "onnxruntime,absent",
                 "--shapes", SHAPES_TEXT, "--json")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert [b["status"] for b in stdout_json(ok)["backends"]] == ["passed", "skipped"]

    golden = tmp_path / "g.npz"
    saved = run_cli("compare", mlp, "--engine", built["ok"], "--save-golden", golden)
    assert saved.returncode == 0, saved.stderr
    assert "PASS" in saved.stdout and "gate: PASSED" in saved.stdout

    report = tmp_path / "r.json"
    bad = run_cli("compare", "--engine", built["broken"], "--golden", golden, "--json-file", report)
    assert bad.returncode == 3, bad.stderr
    assert "FAIL" in bad.stdout
    assert json.loads(report.read_text())["passed"] is False

    nothing = run_cli("compare", mlp, "--backends", "absent", "--shapes", SHAPES_TEXT)
    assert nothing.returncode == 1 and "every backend was skipped" in nothing.stderr

    usage = run_cli("compare", mlp, "--golden", golden, "--save-golden", tmp_path / "x.npz")
    assert usage.returncode == 2
    swallowed = run_cli("compare", "--candidate", "onnxruntime", mlp)
    assert swallowed.returncode == 2 and "goes before --candidate" in swallowed.stderr


def test_inputs_of_the_wrong_rank_or_dtype_are_refused_like_engine_infer(mlp, tmp_path):
    np.save(tmp_path / "rank.npy", np.ones((2, 4, 16), np.float32))
    np.save(tmp_path / "f64.npy", np.ones((2, 16), np.float64))
    for name, message in (
        ("rank", "expected rank 2"),
        ("f64", "expected dtype float32, got float64"),
    ):
        r = run_cli(
            "compare", mlp, "--backends", "onnxruntime", "--input", f"x={tmp_path / name}.npy"
        )
        assert r.returncode == 1, r.stderr
        assert message in r.stderr and "Traceback" not in r.stderr
