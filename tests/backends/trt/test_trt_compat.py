"""Load-time checks of TensorRT artifacts against this TensorRT and GPU (tensorrt/compat.py),
on hand-made manifests: an ArtifactError that says what differs and how to rebuild, instead of
TensorRT's opaque deserialization error.
"""

from __future__ import annotations

import shlex

import pytest

import enginekit as ek
from enginekit.artifact import write_artifact
from enginekit.backends.tensorrt import compat
from enginekit.errors import ArtifactError


def manifest(**target) -> dict:
    return {
        "format_version": 1,
        "backend": {"name": "tensorrt", "version": "10.8.0.43"},
        "source": {"path": "models/resnet.onnx", "sha256": "0" * 64},
        "config": {
            "backend": "tensorrt",
            "profiles": [
                {"x": [[1, 3, 224, 224], [8, 3, 224, 224], [32, 3, 224, 224]]},
                {"x": [[33, 3, 224, 224], [64, 3, 224, 224], [128, 3, 224, 224]]},
            ],
            "precision": "fp16",
            "device": "cuda",
            "options": {"timing_cache": "trt.cache", "builder_optimization_level": 4},
        },
        "target": {
            "kind": "cuda",
            "tensorrt": "10.8.0.43",
            "compute_capability": "9.0",
            "gpu": "NVIDIA H200",
            "hardware_compatibility": "none",
            "version_compatible": False,
            **target,
        },
    }


def test_same_tensorrt_and_gpu_load_without_warnings():
    assert compat.check_loadable(manifest(), "10.8.0.43", "9.0", "NVIDIA H200", "m.ekit") == []


def test_other_tensorrt_version_is_refused_with_a_rebuild_command():
    with pytest.raises(ArtifactError) as info:
        compat.check_loadable(manifest(), "10.9.0.34", "9.0", "NVIDIA H200", "m.ekit")
    message = str(info.value)
    assert "built with TensorRT 10.8.0.43 and this machine has TensorRT 10.9.0.34" in message
    assert "enginekit build models/resnet.onnx --backend tensorrt" in message


def test_other_compute_capability_is_refused():
    with pytest.raises(
        ArtifactError, match=r"compute capability 9.0 \(NVIDIA H200\); this NVIDIA A10"
    ):
        compat.check_loadable(manifest(), "10.8.0.43", "8.6", "NVIDIA A10", "m.ekit")


def test_same_compute_capability_on_another_gpu_loads_with_a_warning():
    warnings = compat.check_loadable(manifest(), "10.8.0.43", "9.0", "NVIDIA H100", "m.ekit")
    assert len(warnings) == 1 and "built on NVIDIA H200, running on NVIDIA H100" in warnings[0]


def test_ampere_plus_plans_load_on_any_ampere_or_newer_gpu():
    m = manifest(hardware_compatibility="ampere_plus")
    assert compat.check_loadable(m, "10.8.0.43", "8.6", "NVIDIA A10", "m.ekit") == []
    with pytest.raises(ArtifactError, match="Ampere and newer"):
        compat.check_loadable(m, "10.8.0.43", "7.5", "Tesla T4", "m.ekit")


@pytest.mark.parametrize(
    ("runtime", "ok"),
    [("10.8.0.43", True), ("10.12.0.1", True), ("10.7.0.23", False), ("11.0.0", False)],
)
def test_version_compatible_plans_load_in_later_runtimes_of_the_same_major(runtime, ok):
    m = manifest(version_compatible=True)
    if ok:
        compat.check_loadable(m, runtime, "9.0", "NVIDIA H200", "m.ekit")
    else:
        with pytest.raises(ArtifactError, match="version-compatible"):
            compat.check_loadable(m, runtime, "9.0", "NVIDIA H200", "m.ekit")


def test_manifest_without_tensorrt_target_is_refused():
    m = manifest()
    del m["target"]["tensorrt"]
    with pytest.raises(ArtifactError, match="lacks the TensorRT version"):
        compat.check_loadable(m, "10.8.0.43", "9.0", "NVIDIA H200", "m.ekit")


def test_rebuild_command_reproduces_the_build_flags():
    cmd = shlex.split(compat.rebuild_command(manifest(), "out dir/m.ekit"))
    assert cmd[:5] == ["enginekit", "build", "models/resnet.onnx", "--backend", "tensorrt"]
    assert cmd.count("--shapes") == 2 and "x:33x3x224x224,64x3x224x224,128x3x224x224" in cmd
    assert cmd[cmd.index("--precision") + 1] == "fp16"
    assert cmd[cmd.index("--timing-cache") + 1] == "trt.cache"
    assert "builder_optimization_level=4" in cmd and cmd[-2:] == ["-o", "out dir/m.ekit"]
    from enginekit.cli import parser

    args = parser().parse_args(cmd[1:])
    assert args.timing_cache == "trt.cache" and args.precision == "fp16"


def test_loading_a_tensorrt_artifact_without_tensorrt_says_how_to_install(tmp_path):
    from enginekit.backends.tensorrt import device

    try:
        device.import_tensorrt()
        pytest.skip("TensorRT is installed here; this checks the message on machines without it")
    except ek.BackendUnavailable:
        pass
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.plan").write_bytes(b"not a real plan")
    path = write_artifact(tmp_path / "m.ekit", manifest(), work, ["model.plan"])
    with pytest.raises(ArtifactError, match="cannot load a tensorrt engine here.*pypi.nvidia.com"):
        ek.load(path)
