"""build(): profile checks, options, verification failures, and nothing half-written on failure."""

from __future__ import annotations

import dataclasses
import importlib
import tempfile

import numpy as np
import pytest
from models import CASES

import enginekit as ek
from enginekit import backends


def test_build_without_output_returns_verified_engine(mlp_path):
    engine = ek.build(mlp_path)
    assert engine.manifest["verify"]["passed"]
    assert engine.infer(np.ones((3, 16), np.float32))["output"].shape == (3, 4)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"y": [(1, 16), (2, 16), (4, 16)]}, "input 'y', which the model does not have"),
        ({"x": [(1,), (2,), (4,)]}, "rank 1; the model's input is rank 2"),
        ({"x": [(1, 8), (2, 8), (4, 8)]}, "dim 1: the model fixes it to 16"),
    ],
)
def test_profiles_are_checked_against_the_model(mlp_path, shapes, message):
    with pytest.raises(ek.BuildError, match=message):
        ek.build(mlp_path, shapes=shapes)


def test_profiles_must_cover_the_same_inputs(onnx_model):
    shapes = [{"a": (2, 8), "b": (2, 4)}, {"a": (4, 8)}]
    with pytest.raises(ek.BuildError, match="every profile must cover the same inputs"):
        ek.build(onnx_model("two_input"), shapes=shapes)


def test_dynamic_dim_without_shapes_asks_for_them(onnx_model):
    with pytest.raises(ek.BuildError, match="'ids' dim 1 is dynamic \\('seq'\\); give its range"):
        ek.build(onnx_model("transformer"))


def test_unknown_backend_option_lists_known_ones(mlp_path):
    with pytest.raises(ek.BuildError, match="no option\\(s\\) 'layout'.*intra_op_threads"):
        ek.build(mlp_path, layout="NHWC")


def test_a_typod_backend_option_gets_the_closest_name(mlp_path):
    with pytest.raises(
        ek.BuildError, match="'optimizaton_level'; did you mean 'optimization_level'"
    ):
        ek.build(mlp_path, optimizaton_level="all")


def test_unknown_backend_and_missing_device(mlp_path):
    with pytest.raises(
        ek.UsageError, match="no backend named 'onnxruntim'; did you mean 'onnxruntime'"
    ):
        ek.build(mlp_path, backend="onnxruntim")
    if "cuda" not in backends.availability("onnxruntime").devices:
        with pytest.raises(ek.BackendUnavailable, match="no 'cuda' device"):
            ek.build(mlp_path, device="cuda")


def test_verification_failure_raises_and_writes_nothing(onnx_model, tmp_path, monkeypatch):
    # A real backend whose engine computes with one weight changed: a broken engine.
    monkeypatch.setitem(backends._BUILTIN, "broken", "broken_backend")
    out = tmp_path / "broken.ekit"
    with pytest.raises(ek.VerificationError, match="output 'output'.*max abs error") as info:
        ek.build(onnx_model("mlp"), backend="broken", shapes=CASES["mlp"].shapes, output=out)
    assert info.value.report["passed"] is False
    assert list(tmp_path.iterdir()) == []


def test_verification_can_be_skipped(onnx_model, monkeypatch):
    monkeypatch.setitem(backends._BUILTIN, "broken", "broken_backend")
    engine = ek.build(onnx_model("mlp"), backend="broken", verify=False)
    assert engine.manifest["verify"] is None


def test_failed_build_leaves_no_files(mlp_path, tmp_path):
    out = tmp_path / "sub" / "m.ekit"
    with pytest.raises(ek.BuildError):
        ek.build(mlp_path, optimization_level="bogus", output=out)
    assert not out.exists() and not any(tmp_path.rglob("*.tmp-*"))


def test_build_key_changes_with_inputs_only(mlp_path, onnx_model):
    a = ek.build(mlp_path, shapes=CASES["mlp"].shapes).manifest["build_key"]
    b = ek.build(mlp_path, shapes=CASES["mlp"].shapes).manifest["build_key"]
    c = ek.build(mlp_path, shapes={"x": [(1, 16), (8, 16), (32, 16)]}).manifest["build_key"]
    d = ek.build(onnx_model("cnn")).manifest["build_key"]
    assert a == b and len({a, c, d}) == 3


def test_options_given_with_a_config_are_added_to_its_options(mlp_path):
    config = ek.BuildConfig(profiles=ek.parse_shapes("x:1x16,8x16,64x16"))
    engine = ek.build(mlp_path, config=config, optimization_level="extended")
    assert engine.manifest["config"]["options"] == {"optimization_level": "extended"}
    with pytest.raises(ek.BuildError, match="no option\\(s\\) 'layout'"):
        ek.build(mlp_path, config=config, layout="NHWC")


def test_a_registered_strategy_takes_over_the_build(mlp_path, tmp_path, monkeypatch):
    stages = importlib.import_module("enginekit.build")
    seen = []

    def first_backend(model, request):
        seen.append(request)
        config = dataclasses.replace(request.config, backend="onnxruntime")
        return ek.build(model, config=config, output=request.output)

    monkeypatch.setitem(stages.STRATEGIES, "first", first_backend)
    out = tmp_path / "m.ekit"
    engine = ek.build(mlp_path, backend="first", output=out, optimization_level="extended")
    (request,) = seen
    assert request.config.backend == "first" and request.output == out
    assert request.config.options == {"optimization_level": "extended"}
    assert engine.manifest["backend"]["name"] == "onnxruntime" and out.is_file()
    # "auto" is registered lazily (enginekit/__init__.py): it calls choose.build_auto.
    choose = importlib.import_module("enginekit.evaluate.choose")
    monkeypatch.setattr(choose, "build_auto", lambda m, r: ("auto", m, r))
    assert stages.STRATEGIES["auto"]("m", "r") == ("auto", "m", "r")


def test_a_failed_verification_removes_the_build_workdir(onnx_model, tmp_path, monkeypatch):
    monkeypatch.setitem(backends._BUILTIN, "broken", "broken_backend")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ek.VerificationError):
        ek.build(onnx_model("mlp"), backend="broken", shapes=CASES["mlp"].shapes)
    assert list(tmp_path.iterdir()) == []
