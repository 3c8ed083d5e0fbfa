"""The build file: TOML -> BuildConfig entries, and every error with its key path and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from enginekit import BuildConfig
from enginekit.config import normalize_shapes
from enginekit.pipeline.config import ConfigError, load

from .helpers import MLP_SHAPES, cli


def problems(path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(path)
    return [i.format(Path(path.name)) for i in info.value.issues]


def test_entries_are_the_build_config_the_api_uses(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [shapes]
        x = ["1x16", "4x16", "8x16"]
        [[engine]]
        backend = "onnxruntime"
        precision = ["fp32", "fp16"]
        options = { intra_op_threads = 1 }
        atol = 1e-3
        """
    )
    cfg = load(path)
    assert [e.id for e in cfg.entries] == ["mlp-onnxruntime-fp32", "mlp-onnxruntime-fp16"]
    expected = BuildConfig(
        backend="onnxruntime",
        profiles=normalize_shapes({"x": [(1, 16), (4, 16), (8, 16)]}),
        precision="fp16",  # type: ignore[arg-type]
        atol=1e-3,
        options={"intra_op_threads": 1},
    )
    assert cfg.entries[1].config == expected


@pytest.mark.parametrize(
    "value",
    ['"1x16,4x16,8x16"', '["1x16", "4x16", "8x16"]', "[[1, 16], [4, 16], [8, 16]]"],
)
def test_every_shape_form_gives_the_same_profile(project, value):
    path = project.write(
        f'[model]\nsource = "mlp.onnx"\n[shapes]\nx = {value}\n[[engine]]\nbackend = "onnxruntime"\n'
    )
    assert load(path).profiles == normalize_shapes({"x": [(1, 16), (4, 16), (8, 16)]})


def test_several_profiles_with_array_of_tables(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [[shapes]]
        x = "1x16,2x16,4x16"
        [[shapes]]
        x = "5x16,8x16,16x16"
        [[engine]]
        backend = "onnxruntime"
        """
    )
    assert [p["x"].max for p in load(path).profiles] == [(4, 16), (16, 16)]


def test_unknown_key_names_path_line_and_suggestion(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"

        [[engine]]
        backend = "onnxruntime"
        variant = "b"
        precison = "fp16"
        """
    )
    (msg,) = problems(path)
    assert msg.startswith(
        "enginekit.toml:12: engine[1].precison: unknown key; did you mean 'precision'?"
    )


def test_bad_shape_string_names_input_and_line(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [shapes]
        x = ["1x16", "4by16", "8x16"]
        [[engine]]
        backend = "onnxruntime"
        """
    )
    (msg,) = problems(path)
    assert msg.startswith("enginekit.toml:4: shapes.x: '4by16' is not a shape")


def test_missing_files_are_reported_with_their_keys(project):
    path = project.write(
        """
        [model]
        source = "models/classifier.onnx"
        [[engine]]
        backend = "onnxruntime"
        [calibration]
        data = "calib/*.npy"
        """
    )
    msgs = problems(path)
    assert msgs[0].startswith("enginekit.toml:2: model.source: ")
    assert "classifier.onnx does not exist" in msgs[0]
    assert msgs[1].startswith("enginekit.toml:6: calibration.data: 'calib/*.npy' matches no file")


def test_profile_with_min_above_max(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [shapes]
        x = "8x16,4x16,1x16"
        [[engine]]
        backend = "onnxruntime"
        """
    )
    (msg,) = problems(path)
    assert msg.startswith("enginekit.toml:4: shapes.x: ")
    assert "min <= opt <= max, got 8, 4, 1" in msg


def test_all_problems_are_reported_at_once(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [shapes]
        x = ["1x16", "4x16", "8x16"]
        y = "1x3"
        [[engine]]
        backend = "onnxruntime"
        precision = "int8"
        layout = "NHWC"
        options = { intra_op_thread = 1 }
        device = "gpu"
        [gates]
        max_abs_error = { fp32 = 1e-4, in8 = 0.05 }
        min_top1_agreement = 1.5
        """
    )
    msgs = problems(path)
    keys = [m.split(": ")[0] + ": " + m.split(": ")[1] for m in msgs]
    assert keys == [
        "enginekit.toml:5: shapes.y",
        "enginekit.toml:8: engine[0].precision",
        "enginekit.toml:9: engine[0].layout",
        "enginekit.toml:10: engine[0].options.intra_op_thread",
        "enginekit.toml:11: engine[0].device",
        "enginekit.toml:13: gates.max_abs_error.in8",
        "enginekit.toml:14: gates.min_top1_agreement",
    ]
    assert "int8 needs a [calibration] section" in msgs[1]
    assert "did you mean 'intra_op_threads'" in msgs[3]


def test_input_the_model_lacks_and_rank_mismatch(project):
    path = project.write(
        """
        [model]
        source = "mlp.onnx"
        [shapes]
        x = "1x16x1,4x16x1,8x16x1"
        [[engine]]
        backend = "onnxruntime"
        """
    )
    (msg,) = problems(path)
    assert msg.startswith("enginekit.toml:4: shapes.x: ") and "rank 3" in msg


def test_toml_syntax_error_has_its_line(project):
    path = project.write('[model]\nsource = "mlp.onnx"\n[[engine]\nbackend = 1\n')
    (msg,) = problems(path)
    assert msg.startswith("enginekit.toml:3: (top level): not valid TOML")


def test_two_entries_with_one_artifact_name_are_refused(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        [[engine]]
        backend = "onnxruntime"
        options = {{ optimization_level = "basic" }}
        """
    )
    (msg,) = problems(path)
    assert "engine[1]" in msg and "variant" in msg


def test_unregistered_backend_is_an_error_with_the_closest_name(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntim"
        """
    )
    with pytest.raises(ConfigError) as info:
        load(path)
    (issue,) = info.value.issues
    assert issue.line == 7 and "did you mean 'onnxruntime'" in issue.message


def test_cli_typod_backend_exits_2_and_unavailable_with_strict_exits_1(project):
    plugins = str(Path(__file__).parents[1] / "plugins")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), plugins])}
    engines = '[[engine]]\nbackend = "onnxruntime"\n[[engine]]\nbackend = "{}"\n'
    base = f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[bench]\nenabled = false\n'
    typo = project.write(base + engines.format("tvn"))
    r = cli("build", "-c", str(typo), "--out", str(project.root / "d1"), env=env)
    assert r.returncode == 2 and "did you mean 'tvm'?" in r.stderr
    absent = project.write(base + engines.format("absent"))
    r = cli("build", "-c", str(absent), "--out", str(project.root / "d2"), env=env)
    assert r.returncode == 0, r.stderr
    r = cli("build", "-c", str(absent), "--strict", "--out", str(project.root / "d3"), env=env)
    assert r.returncode == 1 and "absent runtime is not installed" in r.stdout + r.stderr


def test_layout_list_names_each_entry(project, broken_backend, monkeypatch):
    from enginekit.backends import get

    monkeypatch.setitem(get("broken").OPTIONS, "layout", "test layout option")
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "broken"
        layout = ["NCHW", "NHWC"]
        """
    )
    entries = load(path).entries
    assert [e.id for e in entries] == ["mlp-broken-fp32-nchw", "mlp-broken-fp32-nhwc"]
    assert entries[1].config.options == {"layout": "NHWC"}


def test_validate_command_exit_codes(project):
    good = project.write(
        f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "onnxruntime"\n'
    )
    bad = project.write(
        '[model]\nsource = "nope.onnx"\n[[engine]]\nbackend = "onnxruntime"\n', "bad.toml"
    )
    ok = cli("validate", "-c", str(good), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["entries"][0]["id"] == "mlp-onnxruntime-fp32"
    r = cli("validate", "-c", str(bad))
    assert r.returncode == 2
    assert f"{bad}:2: model.source:" in r.stderr


def test_github_annotations_point_at_the_line(project):
    import os

    bad = project.write('[model]\nsource = "nope.onnx"\n[[engine]]\nbackend = "onnxruntime"\n')
    r = cli("validate", "-c", str(bad), env={**os.environ, "GITHUB_ACTIONS": "true"})
    assert r.returncode == 2
    assert f"::error file={bad},line=2::" in r.stdout


def test_simplify_and_outputs_map_onto_the_build_config(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        outputs = ["output"]
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        simplify = false
        """
    )
    config = load(path).entries[0].config
    assert (config.simplify, config.outputs) == (False, ("output",))
    bad = project.write(path.read_text().replace('["output"]', '["outptu"]'), "bad.toml")
    (msg,) = problems(bad)
    assert msg.startswith("bad.toml:3: model.outputs[0]: the model computes no tensor 'outptu'")
