"""The enginekit command end to end, through subprocess, with its documented exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import reference

TESTS = Path(__file__).parents[1]


def cli(*args: str, cwd: Path | None = None, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); {prelude}from enginekit.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.fixture(scope="module")
def built(mlp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "mlp.ekit"
    r = cli(
        "build",
        str(mlp_path),
        "--backend",
        "onnxruntime",
        "--shapes",
        "x:1x16,8x16,64x16",
        "-o",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "verified against ONNX Runtime CPU" in r.stdout
    return out


def test_console_script_is_installed():
    r = subprocess.run(
        [Path(sys.executable).with_name("enginekit"), "--version"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("enginekit ")


def test_build_json_prints_manifest(mlp_path, tmp_path):
    out = tmp_path / "m.ekit"
    r = cli(
        "build",
        str(mlp_path),
        "--shapes",
        "x:1x16,8x16,64x16",
        "-O",
        "intra_op_threads=1",
        "-o",
        str(out),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["config"]["options"] == {"intra_op_threads": 1}
    assert manifest["profiles"] == [{"x": [[1, 16], [8, 16], [64, 16]]}]


def test_run_with_npy_and_npz(built, mlp_path, tmp_path):
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "in.npz", x=x)
    want = reference(mlp_path, {"x": x})["output"]
    for spec in ("x=" + str(tmp_path / "x.npy"), str(tmp_path / "in.npz")):
        out = tmp_path / "out.npz"
        r = cli("run", str(built), "--input", spec, "-o", str(out))
        assert r.returncode == 0, r.stderr
        with np.load(out) as z:
            np.testing.assert_allclose(z["output"], want, atol=1e-5)
    r = cli("run", str(built), "--input", str(tmp_path / "in.npz"), "--json")
    assert json.loads(r.stdout)["outputs"]["output"]["shape"] == [5, 4]


def test_inspect_model_and_artifact(built, mlp_path):
    r = cli("inspect", str(mlp_path), "--json")
    info = json.loads(r.stdout)
    assert info["kind"] == "onnx" and info["batch_lint"]["passed"] is True
    assert info["inputs"][0]["shape"] == ["batch", 16]
    r = cli("inspect", str(built))
    assert (
        r.returncode == 0
        and "backend    onnxruntime" in r.stdout
        and "verified   passed" in r.stdout
    )
    assert json.loads(cli("inspect", str(built), "--json").stdout)["kind"] == "artifact"


def test_backends_lists_availability():
    rows = json.loads(cli("backends", "--json").stdout)
    ort = next(r for r in rows if r["name"] == "onnxruntime")
    assert ort["available"] and "cpu" in ort["devices"] and "optimization_level" in ort["options"]
    assert "onnxruntime" in cli("backends").stdout


def test_usage_errors_exit_2(built, tmp_path):
    assert cli().returncode == 2
    assert cli("build", "m.onnx").returncode == 2  # no -o
    r = cli("run", str(built))
    assert r.returncode == 2 and "needs --input" in r.stderr
    r = cli("run", str(built), "--input", "x=" + str(tmp_path / "missing.npy"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = cli("build", "m.onnx", "-o", "x.ekit", "-O", "novalue")
    assert r.returncode == 2 and "key=value" in r.stderr


def test_failures_exit_1_with_typed_error(built, mlp_path, tmp_path):
    bad = tmp_path / "bad.ekit"
    bad.write_bytes(built.read_bytes()[:200])
    r = cli("run", str(bad), "--input", "x=" + str(tmp_path / "x.npy"))
    assert r.returncode in (1, 2)
    np.save(tmp_path / "x.npy", np.zeros((2, 16), np.float64))
    r = cli("run", str(bad), "--input", "x=" + str(tmp_path / "x.npy"))
    assert r.returncode == 1 and "ArtifactError" in r.stderr
    r = cli("run", str(built), "--input", "x=" + str(tmp_path / "x.npy"))
    assert r.returncode == 1 and "EngineInputError" in r.stderr and "float64" in r.stderr
    r = cli("build", str(mlp_path), "--shapes", "x:1x8", "-o", str(tmp_path / "m.ekit"))
    assert r.returncode == 1 and "fixes it to 16" in r.stderr


def test_verification_failure_exits_3_and_writes_nothing(mlp_path, tmp_path):
    out = tmp_path / "broken.ekit"
    prelude = "from enginekit.backends import _BUILTIN; _BUILTIN['broken'] = 'broken_backend'; "
    r = cli("build", str(mlp_path), "--backend", "broken", "-o", str(out), prelude=prelude)
    assert r.returncode == 3, r.stderr
    assert "verification failed" in r.stderr and not out.exists()


@pytest.mark.parametrize("module", ["enginekit", "enginekit.cli"])
def test_python_dash_m_runs_the_command(module):
    import enginekit

    r = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == f"enginekit {enginekit.__version__}"


def test_typos_get_the_closest_name_and_the_subcommands_usage(mlp_path, tmp_path):
    out = str(tmp_path / "m.ekit")
    flag = cli("build", str(mlp_path), "--backnd", "onnxruntime", "-o", out)
    assert flag.returncode == 2
    assert (
        flag.stderr.startswith("usage: enginekit build")
        and "did you mean --backend?" in flag.stderr
    )
    backend = cli("build", str(mlp_path), "--backend", "onnxruntim", "-o", out)
    assert backend.returncode == 2 and "did you mean 'onnxruntime'?" in backend.stderr
    option = cli("build", str(mlp_path), "-O", "optimizaton_level=all", "-o", out)
    assert "did you mean 'optimization_level'?" in option.stderr
    outputs = cli("prepare", str(mlp_path), "--outputs", "relu_3", "-o", str(tmp_path / "p.onnx"))
    assert outputs.returncode == 1 and "did you mean 'relu'" in outputs.stderr
    nothing_alike = cli(
        "prepare", str(mlp_path), "--outputs", "hidden_3", "-o", str(tmp_path / "p.onnx")
    )
    assert "its tensors: " in nothing_alike.stderr and "'relu'" in nothing_alike.stderr


def test_backends_answers_from_package_metadata_without_importing_frameworks():
    probe = "import sys, json; from enginekit.cli import main; main(['backends', '--json']); "
    probe += "print(sorted(m for m in ('tvm', 'jax', 'tensorflow', 'torch') if m in sys.modules), file=sys.stderr)"
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=TESTS.parent
    )
    assert r.returncode == 0 and r.stderr.strip() == "[]", r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["onnxruntime"]["probed"] and "cpu" in rows["onnxruntime"]["devices"]
    for name in ("tvm", "xla"):  # installed here: a version from metadata, devices not probed
        if rows[name]["available"]:
            assert rows[name]["version"] and rows[name]["probed"] is False


def test_backends_check_probes_devices_and_lists_only_precisions_the_host_builds():
    rows = {r["name"]: r for r in json.loads(cli("backends", "--check", "--json").stdout)}
    assert all(r["probed"] for r in rows.values())
    ort = rows["onnxruntime"]
    if "cuda" not in ort["devices"]:  # ONNX Runtime's CPU provider has no bf16 kernels
        assert "bf16" not in ort["precisions"] and "int8" in ort["precisions"]
    assert (
        "bf16" not in json.loads(cli("backends", "--json").stdout)[0]["precisions"]
        or "cuda" in ort["devices"]
    )


def test_inspect_says_what_an_artifact_really_holds(mlp_path, tmp_path):
    (tmp_path / "empty.ekit").write_bytes(b"")
    (tmp_path / "text.ekit").write_text("not an artifact")
    for name in ("empty.ekit", "text.ekit"):
        r = cli("inspect", str(tmp_path / name))
        assert r.returncode == 1 and "not a valid .ekit file, truncated or corrupt" in r.stderr
    np.savez(
        tmp_path / "calib.npz",
        x=np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32),
    )
    out = tmp_path / "i8.ekit"
    built = cli("build", str(mlp_path), "--shapes", "x:1x16,8x16,16x16", "--precision", "int8",
                "--calib-data", str(tmp_path / "calib.npz"), "-o", str(out))  # fmt: skip
    assert built.returncode == 0, built.stderr
    text = cli("inspect", str(out)).stdout
    assert "simplify skipped (Q/DQ model)" in text and "simplify 1" not in text
    assert "calibration entropy on" in text and "agreement  output: max abs" in text
    backend = next(line for line in text.splitlines() if line.startswith("backend"))
    assert "{" not in backend and "None" not in backend


def test_inspect_lints_a_model_with_a_sequence_dim(tmp_path):
    from onnx import TensorProto, helper, save

    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq"]) for n in ("a", "b")
    ]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq"])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["out"])], "g", inputs, [out])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    save(proto, str(tmp_path / "enc.onnx"))
    r = cli("inspect", str(tmp_path / "enc.onnx"))
    assert r.returncode == 0 and "batch lint ok" in r.stdout and "shapes=" not in r.stdout
