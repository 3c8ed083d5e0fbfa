"""ONNX Runtime's TensorRT execution provider options from enginekit profiles
(tensorrt/ortep.py) and their wiring into the onnxruntime backend."""

from __future__ import annotations

import pytest

from enginekit.backends import onnxruntime as ort_backend
from enginekit.backends.tensorrt import ortep
from enginekit.config import BuildConfig, ShapeProfile, normalize_shapes, parse_shapes
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError

X = TensorSpec("x", "float32", ("batch", 3, 224, 224))
SCALE = TensorSpec("scale", "float32", (1,))
IDS = TensorSpec("ids", "int64", ("batch", "seq"))
MASK = TensorSpec("mask", "int64", ("batch", "seq"))


def test_two_profiles_repeat_the_input_name_in_onnxruntime_format():
    profiles = parse_shapes(
        ["x:1x3x224x224,8x3x224x224,32x3x224x224", "x:33x3x224x224,64x3x224x224,128x3x224x224"]
    )
    got = ortep.profile_shapes([X], profiles)
    assert got == {
        "trt_profile_min_shapes": "x:1x3x224x224,x:33x3x224x224",
        "trt_profile_opt_shapes": "x:8x3x224x224,x:64x3x224x224",
        "trt_profile_max_shapes": "x:32x3x224x224,x:128x3x224x224",
    }


def test_only_dynamic_inputs_are_listed_in_input_order():
    profiles = normalize_shapes(
        {"mask": [(1, 2), (4, 8), (8, 16)], "ids": [(1, 2), (4, 8), (8, 16)], "scale": (1,)}
    )
    got = ortep.profile_shapes([IDS, SCALE, MASK], profiles)
    assert got["trt_profile_min_shapes"] == "ids:1x2,mask:1x2"
    assert got["trt_profile_max_shapes"] == "ids:8x16,mask:8x16"


def test_static_model_gets_no_profile_options():
    assert ortep.profile_shapes([SCALE], ()) == {}


def test_every_dynamic_input_must_be_covered():
    with pytest.raises(BuildError, match="profile 0 gives no shapes for input 'mask'"):
        ortep.profile_shapes([IDS, MASK], normalize_shapes({"ids": [(1, 2), (4, 8), (8, 16)]}))


def test_input_names_the_option_format_cannot_carry_are_refused():
    odd = TensorSpec("input:0", "float32", ("batch", 4))
    profile = {"input:0": ShapeProfile((1, 4), (2, 4), (4, 4))}
    with pytest.raises(BuildError, match="cannot name an input containing"):
        ortep.profile_shapes([odd], [profile])


@pytest.mark.parametrize(
    ("precision", "flag"),
    [("fp16", "trt_fp16_enable"), ("bf16", "trt_bf16_enable"), ("int8", "trt_int8_enable")],
)
def test_precision_turns_on_its_flag(precision, flag):
    options = ortep.provider_options([SCALE], (), precision)
    assert options[flag] == "True"
    assert not {k for k in options if k.endswith("_enable")} - {flag}


def test_engine_cache_options_and_extra_options_are_strings():
    options = ortep.provider_options(
        [SCALE], (), "fp32", cache_dir="/tmp/c", device_id=1,
        extra={"trt_builder_optimization_level": 5, "trt_cuda_graph_enable": True},
    )  # fmt: skip
    assert options == {
        "device_id": "1",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": "/tmp/c",
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": "/tmp/c",
        "trt_builder_optimization_level": "5",
        "trt_cuda_graph_enable": "True",
    }


def test_onnxruntime_backend_gives_the_tensorrt_provider_its_options(tmp_path):
    config = BuildConfig(
        backend="onnxruntime",
        profiles=normalize_shapes({"x": [(1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224)]}),
        precision="fp16",
        device="cuda:1",
        options={
            "providers": ["tensorrt", "cuda"],
            "trt_options": {"trt_max_workspace_size": 1 << 30},
        },
    )
    providers = ort_backend._providers(dict(config.options), config.device)
    assert providers == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    trt = ort_backend._trt_options([X], config, tmp_path, config.device)
    per_provider = ort_backend._provider_options(providers, config.device, trt)
    assert per_provider[0]["trt_profile_opt_shapes"] == "x:8x3x224x224"
    assert per_provider[0]["trt_fp16_enable"] == "True"
    assert per_provider[0]["trt_engine_cache_path"] == str(tmp_path)
    assert per_provider[0]["trt_max_workspace_size"] == str(1 << 30)
    assert per_provider[1:] == [{"device_id": "1"}, {}]
    assert "trt_options" in ort_backend.OPTIONS
