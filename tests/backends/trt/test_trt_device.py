"""The parts of tensorrt/device.py and tensorrt/cuda.py that run without TensorRT or a GPU:
the Polygraphy builder configuration a plan maps to, and reading CUDA arrays handed in."""

from __future__ import annotations

import ctypes.util

import numpy as np
import pytest
import trt_models

from enginekit.backends.tensorrt import cuda, device, plan
from enginekit.config import BuildConfig, normalize_shapes
from enginekit.errors import EnginekitError
from enginekit.model import load_model


def build_plan(precision: str, version: str, **options) -> plan.BuildPlan:
    model = load_model(trt_models.mlp())
    config = BuildConfig(
        backend="tensorrt",
        profiles=normalize_shapes(
            [{"x": [(1, 16), (8, 16), (32, 16)]}, {"x": [(33, 16), (64, 16), (128, 16)]}]
        ),
        precision=precision,
        device="cuda",
        options=options,
    )
    return plan.plan_build(model, config, version, has_quantizer=True)


def test_tensorrt_10_fp16_sets_the_fp16_flag_and_clears_tf32():
    kwargs = device.config_kwargs(build_plan("fp16", "10.8.0.43"))
    assert (kwargs["fp16"], kwargs["bf16"], kwargs["int8"], kwargs["tf32"]) == (
        True,
        False,
        False,
        False,
    )


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_tensorrt_11_sets_no_precision_flag(precision):
    kwargs = device.config_kwargs(build_plan(precision, "11.0.0"))
    assert not (kwargs["fp16"] or kwargs["bf16"] or kwargs["int8"])


def test_builder_options_reach_the_config_by_enum_name():
    kwargs = device.config_kwargs(
        build_plan(
            "fp32", "10.8.0.43", workspace="1GiB", builder_optimization_level=5,
            hardware_compatibility="ampere_plus", version_compatible=True, tf32=True,
        )
    )  # fmt: skip
    assert kwargs["memory_pool_limits"] == {"WORKSPACE": 1 << 30}
    assert kwargs["builder_optimization_level"] == 5
    assert kwargs["hardware_compatibility_level"] == "AMPERE_PLUS"
    assert kwargs["version_compatible"] is True and kwargs["tf32"] is True


def test_profiles_become_polygraphy_profiles_in_order():
    profiles = device.config_kwargs(build_plan("fp32", "10.8.0.43"))["profiles"]
    assert [tuple(p["x"].max) for p in profiles] == [(32, 16), (128, 16)]
    assert [tuple(p["x"].opt) for p in profiles] == [(8, 16), (64, 16)]


def test_device_index_from_device_name():
    assert (device.device_index("cuda"), device.device_index("cuda:3")) == (0, 3)


class FakeCudaArray:
    """An object speaking __cuda_array_interface__ (what torch CUDA tensors and cupy expose)."""

    def __init__(self, shape, typestr="<f4", strides=None, stream=None):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (0x7F0000001000, False),
            "version": 3, "strides": strides, "stream": stream,
        }  # fmt: skip


def test_cuda_array_interface_is_read_into_a_view():
    view = cuda.parse_cuda_array(FakeCudaArray((2, 3), stream=1), "x")
    assert (view.ptr, view.shape, view.dtype, view.stream) == (
        0x7F0000001000,
        (2, 3),
        np.float32,
        1,
    )
    assert view.nbytes == 24 and view.ndim == 2
    assert cuda.parse_cuda_array(FakeCudaArray((2, 3), strides=(12, 4)), "x").shape == (2, 3)
    assert cuda.is_cuda_array(FakeCudaArray((1,))) and not cuda.is_cuda_array(np.zeros(1))


def test_non_contiguous_cuda_array_is_refused_with_the_fix():
    with pytest.raises(EnginekitError, match=r"not C-contiguous.*contiguous\(\)"):
        cuda.parse_cuda_array(FakeCudaArray((2, 3), strides=(4, 8)), "x")


def test_host_view_reads_and_writes_the_memory_at_the_address():
    buf = (ctypes.c_float * 6)(*range(6))
    view = cuda.host_view(ctypes.addressof(buf), 24, (2, 3), np.float32)
    assert view.tolist() == [[0, 1, 2], [3, 4, 5]]
    view[1, 2] = 42.0
    assert buf[5] == 42.0
    with pytest.raises(ValueError, match="needs 28 bytes"):
        cuda.host_view(ctypes.addressof(buf), 24, (7,), np.float32)


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="an NVIDIA driver is here")
def test_without_a_driver_there_are_no_devices_and_a_clear_error():
    assert cuda.device_count() == 0
    with pytest.raises(cuda.CudaError, match="no NVIDIA driver"):
        cuda.Driver()
