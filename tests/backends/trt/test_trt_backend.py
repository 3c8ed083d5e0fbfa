"""The tensorrt backend's contract on a machine without TensorRT or a GPU: it registers, says why
it is unavailable and how to install, refuses builds with that reason, and the CLI maps its flags.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import trt_models

import enginekit as ek
from enginekit import backends
from enginekit.backends import tensorrt as backend
from enginekit.cli import main, parser
from enginekit.cli.build import backend_flag_options
from enginekit.config import BuildConfig, parse_shapes
from enginekit.errors import BuildError
from enginekit.model import load_model


def _has_tensorrt() -> bool:
    from enginekit.backends.tensorrt import device

    try:
        device.import_tensorrt()
    except ek.BackendUnavailable:
        return False
    return True


HAS_TRT = _has_tensorrt()
no_trt = pytest.mark.skipif(HAS_TRT, reason="checks the messages of machines without TensorRT")


def test_tensorrt_is_registered_with_options_and_precisions():
    assert "tensorrt" in backends.names()
    assert backends.get("tensorrt") is backend
    assert set(backend.PRECISIONS) == {"fp32", "fp16", "bf16", "int8"}
    assert {"timing_cache", "workspace", "builder_optimization_level", "qdq_model"} <= set(
        backend.OPTIONS
    )


@no_trt
def test_unavailable_without_tensorrt_with_how_to_install():
    avail = backend.available()
    assert not avail.available and avail.devices == ()
    assert "TensorRT is not installed" in avail.reason
    assert "pypi.nvidia.com" in avail.reason and "nvcr.io" in avail.reason


@no_trt
def test_a_directory_named_tensorrt_on_the_path_is_not_taken_for_tensorrt(tmp_path, monkeypatch):
    from enginekit.backends.tensorrt import device

    (tmp_path / "tensorrt").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    importlib.invalidate_caches()
    try:
        with pytest.raises(ek.BackendUnavailable, match="found only the directory"):
            device.import_tensorrt()
    finally:
        sys.modules.pop("tensorrt", None)  # not through monkeypatch: it would restore the fake


@no_trt
def test_build_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ek.BackendUnavailable, match="TensorRT is not installed"):
        ek.build(
            trt_models.mlp(),
            backend="tensorrt",
            shapes={"x": [(1, 16), (8, 16), (32, 16)]},
            precision="fp16",
            device="cuda",
            output=tmp_path / "m.ekit",
        )


def test_building_for_the_cpu_is_refused_before_touching_tensorrt(tmp_path):
    model = load_model(trt_models.mlp())
    with pytest.raises(BuildError, match="TensorRT builds for a GPU.*--device cuda"):
        backend.build(model, BuildConfig(backend="tensorrt", device="cpu"), tmp_path)


def test_cli_flags_map_to_backend_options_and_repeated_shapes_make_profiles():
    args = parser().parse_args(
        [
            "build", "model.onnx", "--backend", "tensorrt",
            "--shapes", "x:1x3x224x224,8x3x224x224,32x3x224x224",
            "--shapes", "x:33x3x224x224,64x3x224x224,128x3x224x224",
            "--precision", "int8", "--timing-cache", "trt.cache", "--workspace", "4GiB",
            "-o", "model.ekit",
        ]
    )  # fmt: skip
    assert backend_flag_options(args) == {"timing_cache": "trt.cache", "workspace": "4GiB"}
    profiles = parse_shapes([s for group in args.shapes for s in group])
    assert [p["x"].opt[0] for p in profiles] == [8, 64]
    plain = parser().parse_args(["build", "model.onnx", "-o", "m.ekit"])
    assert backend_flag_options(plain) == {}


@no_trt
def test_cli_build_without_tensorrt_fails_with_exit_1_and_the_reason(tmp_path, capsys):
    import onnx

    onnx.save(trt_models.mlp(), tmp_path / "m.onnx")
    code = main(
        [
            "build", str(tmp_path / "m.onnx"), "--backend", "tensorrt", "--device", "cuda",
            "--shapes", "x:1x16,8x16,32x16", "--timing-cache", str(tmp_path / "trt.cache"),
            "-o", str(tmp_path / "m.ekit"),
        ]
    )  # fmt: skip
    assert code == 1
    assert "TensorRT is not installed" in capsys.readouterr().err
    assert not (tmp_path / "m.ekit").exists()


def test_cli_backends_lists_tensorrt_ops_and_precisions(capsys):
    import json

    assert main(["backends", "--ops", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    trt = rows["tensorrt"]
    assert "Conv" in trt["supported_ops"] and trt["precisions"] == list(backend.PRECISIONS)
    assert trt["available"] or trt["reason"]
