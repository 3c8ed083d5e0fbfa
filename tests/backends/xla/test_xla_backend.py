"""The XLA backend's contract: build/load through enginekit, artifacts, options, inspect."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

from conftest import reference
from models import CASES

import enginekit as ek
from enginekit.artifact import open_artifact
from enginekit.backends import xla
from enginekit.backends.xla.tune import FLAG_SETS

REQUIRED_OPS = """Conv ConvTranspose BatchNormalization Relu LeakyRelu Sigmoid Tanh Gelu Erf Softmax
LogSoftmax MaxPool AveragePool GlobalAveragePool Gemm MatMul Add Sub Mul Div Pow Sqrt Exp Log Neg
Abs Reshape Flatten Transpose Squeeze Unsqueeze Concat Split Slice Gather Expand Tile Pad ReduceSum
ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
ReduceSumSquare Cast Shape ConstantOfShape Range Where Equal Less Greater Not And
LayerNormalization Dropout Identity Constant LRN Clip Sum Min Max Mean QuantizeLinear
DequantizeLinear""".split()


@pytest.fixture(scope="module")
def cnn_artifact(onnx_model, tmp_path_factory) -> Path:
    """The conformance CNN built with default options (nhwc, XLA options measured)."""
    out = tmp_path_factory.mktemp("xla") / "cnn"
    ek.build(onnx_model("cnn"), backend="xla", shapes=CASES["cnn"].shapes, output=f"{out}/")
    return out


def test_required_ops_are_supported():
    assert set(REQUIRED_OPS) <= set(xla.supported_ops())


def test_manifest_records_layout_measured_flags_and_symbolic_dims(cnn_artifact):
    meta = open_artifact(cnn_artifact).manifest["backend"]["metadata"]
    assert meta["layout"] == "nhwc"
    assert meta["xla_flags"] in FLAG_SETS
    assert meta["compiler_options"] == FLAG_SETS[meta["xla_flags"]]
    assert {(t["layout"], t["flags"]) for t in meta["tuning"]} == {("nhwc", f) for f in FLAG_SETS}
    best = min(meta["tuning"], key=lambda t: t["ms"])
    assert best["flags"] == meta["xla_flags"]
    assert meta["symbolic_dims"] == {"x": ["batch", 3, 16, 16]}
    assert meta["buckets"] == "pow2"
    assert meta["lowering"]["pretransformed_weights"] == 2  # both Conv kernels, as HWIO


def test_layout_auto_measures_both_layouts(onnx_model):
    engine = ek.build(
        onnx_model("cnn"), backend="xla", shapes=CASES["cnn"].shapes, verify=False,
        layout="auto", xla_flags="ynn-off",
    )  # fmt: skip
    meta = engine.manifest["backend"]["metadata"]
    assert {t["layout"] for t in meta["tuning"]} == {"nhwc", "nchw"}
    assert meta["layout"] == min(meta["tuning"], key=lambda t: t["ms"])["layout"]
    assert meta["layout_choice"] == "measured at build time"


FRESH = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import enginekit as ek
    engine = ek.load(sys.argv[1])
    out = engine.infer(np.load(sys.argv[2]))
    np.save(sys.argv[3], out[engine.outputs[0].name])
    print(json.dumps({"programs": engine.programs, "options": engine.compiler_options}))
    """
)


@pytest.mark.slow
def test_artifact_loads_and_runs_in_a_fresh_process(cnn_artifact, onnx_model, tmp_path):
    x = CASES["cnn"].feeds(3, seed=7)["x"]
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "PYTHONPATH": str(Path(ek.__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(cnn_artifact), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report["programs"]) == ["4x3x16x16"]  # batch 3 ran in the bucket of 4
    meta = open_artifact(cnn_artifact).manifest["backend"]["metadata"]
    assert report["options"] == meta["compiler_options"]
    want = reference(onnx_model("cnn"), {"x": x})
    np.testing.assert_allclose(
        np.load(tmp_path / "y.npy"), next(iter(want.values())), rtol=1e-3, atol=1e-4
    )


@pytest.mark.slow
def test_persistent_compilation_cache_fills_in_a_fresh_process(mlp_path, tmp_path):
    cache = tmp_path / "cache"
    shapes = {"x": [(1, 16), (4, 16), (4, 16)]}
    ek.build(
        mlp_path, backend="xla", shapes=shapes, verify=False, output=tmp_path / "m.ekit",
        xla_flags="ynn-off", cache_dir=str(cache),
    )  # fmt: skip
    np.save(tmp_path / "x.npy", np.ones((2, 16), np.float32))
    env = {**os.environ, "PYTHONPATH": str(Path(ek.__file__).parent.parent)}
    args = [
        sys.executable,
        "-c",
        FRESH,
        str(tmp_path / "m.ekit"),
        str(tmp_path / "x.npy"),
        str(tmp_path / "y.npy"),
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(cache.iterdir()), "no compiled program was written to the cache"


def _rewrite_payload(artifact: Path, name: str, data: bytes) -> None:
    """Replace a payload file and its manifest checksum, as a careless tool would."""
    (artifact / "payload" / name).write_bytes(data)
    manifest_path = artifact / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["payload"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.write_text(json.dumps(manifest))


@pytest.fixture
def copy_of(cnn_artifact, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(cnn_artifact, target)
    return target


def test_tampered_weights_are_an_artifact_error(copy_of):
    weights = copy_of / "payload" / xla.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ek.ArtifactError, match="checksum"):
        ek.load(copy_of)


def test_unreadable_program_is_an_artifact_error(copy_of):
    _rewrite_payload(copy_of, xla.PROGRAM, b"\x00" * 64)
    with pytest.raises(ek.ArtifactError, match="StableHLO payload cannot be read"):
        ek.load(copy_of)


def test_unreadable_weights_are_an_artifact_error(copy_of):
    _rewrite_payload(copy_of, xla.WEIGHTS, b"not safetensors")
    with pytest.raises(ek.ArtifactError, match="not a readable safetensors"):
        ek.load(copy_of)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"layout": "nwhc"}, "layout"),
        ({"xla_flags": "fastest"}, "xla_flags"),
        ({"buckets": "fibonacci"}, "buckets"),
        ({"precompile": "everything"}, "precompile"),
        ({"threads": 4}, "no option"),
    ],
)
def test_bad_options_are_build_errors(mlp_path, option, match):
    with pytest.raises(ek.BuildError, match=match):
        ek.build(mlp_path, backend="xla", shapes={"x": (2, 16)}, **option)


def test_xla_options_apply_per_engine(mlp_path, tmp_path):
    shapes = {"x": [(1, 16), (8, 16), (8, 16)]}
    found = {}
    for flags in ("xla-default", {"xla_cpu_experimental_ynn_fusion_type": ""}):
        out = tmp_path / f"{len(found)}.ekit"
        ek.build(mlp_path, backend="xla", shapes=shapes, verify=False, output=out, xla_flags=flags)
        found[len(found)] = xla.inspect(open_artifact(out), ir=True)
    assert found[1]["compiler_options"] == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert "__ynn_fusion" not in found[1]["ir"]["library_calls"]
    assert found[0]["ir"]["library_calls"] != found[1]["ir"]["library_calls"]


def test_inspect_reports_the_optimized_programs_fusions(cnn_artifact):
    info = xla.inspect(open_artifact(cnn_artifact), ir=True)
    ir = info["ir"]
    assert ir["fusions"] >= 1 and ir["fusions"] == sum(ir["fusion_kinds"].values())
    assert ir["convolutions"] == 2
    assert ir["stablehlo_ops"]["convolution"] == 2
    assert ir["shapes"] == {"x": [4, 3, 16, 16]}
    assert info["layout"] == "nhwc"


def test_cli_backends_ops_lists_the_xla_op_table():
    env = {**os.environ, "PYTHONPATH": str(Path(ek.__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "enginekit.cli", "backends", "--ops"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    section = done.stdout.split("\nxla ", 1)[1]
    assert f"{len(xla.supported_ops())} ONNX ops" in section
    assert "ConvTranspose" in section and "LayerNormalization" in section


def test_fixed_batch_profile_builds_and_splits_larger_batches(onnx_model):
    path = onnx_model("cnn")
    engine = ek.build(path, backend="xla", shapes={"x": (4, 3, 16, 16)})
    for batch in (4, 9):  # 9 = 4 + 4 + 1 padded to the fixed batch
        feeds = CASES["cnn"].feeds(batch, seed=batch)
        np.testing.assert_allclose(
            engine.infer(feeds)["output"], reference(path, feeds)["output"], atol=1e-4, rtol=1e-3
        )
