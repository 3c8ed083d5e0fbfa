"""Provider options for ONNX Runtime's TensorRT execution provider, from the same profiles.

The second route to TensorRT: the onnxruntime backend with ``providers=["tensorrt", "cuda"]``.
ONNX Runtime builds the TensorRT engines itself; enginekit gives it explicit profiles
(``trt_profile_min/opt/max_shapes``) and an engine cache directory whose files become payload
files of the artifact, so a load does not rebuild. Pure Python.

Format (ONNX Runtime's ``ParseProfileShapes``): ``"x:1x3x224x224,y:1x4"``; an input named again
starts the next profile. Only inputs with a dynamic dim may be listed: ONNX Runtime compares
the count with the dynamic inputs it sees and rebuilds the engine when they differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from enginekit.backends.tensorrt.plan import dynamic_axes, plan_profiles
from enginekit.config import Precision, ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError

#: Precision -> the TensorRT EP option that enables it (int8 expects a Q/DQ model).
_PRECISION_FLAG = {
    Precision.FP16: "trt_fp16_enable",
    Precision.BF16: "trt_bf16_enable",
    Precision.INT8: "trt_int8_enable",
}


def profile_shapes(
    inputs: Sequence[TensorSpec], profiles: Sequence[Mapping[str, ShapeProfile]]
) -> dict[str, str]:
    """``trt_profile_min_shapes`` / ``_opt_`` / ``_max_`` values; empty for a static model.

    Raises:
        BuildError: profiles that do not cover every dynamic input (the EP requires all), or an
            input name that its format cannot carry (``,`` or ``:``).
    """
    complete = plan_profiles(inputs, profiles) if profiles else ()
    dynamic = [s for s in inputs if dynamic_axes(s)]
    if not complete:
        return {}
    for s in dynamic:
        if "," in s.name or ":" in s.name:
            raise BuildError(
                f"input {s.name!r}: ONNX Runtime's TensorRT profile options cannot name an input "
                "containing ',' or ':'; rename it (or use the tensorrt backend)"
            )
        if not s.shape:
            raise BuildError(f"input {s.name!r} is a scalar; profile options need a shape")
    out = {}
    for point in ("min", "opt", "max"):
        entries = [
            f"{s.name}:{'x'.join(str(d) for d in getattr(p[s.name], point))}"
            for p in complete
            for s in dynamic
        ]
        out[f"trt_profile_{point}_shapes"] = ",".join(entries)
    return out


def provider_options(
    inputs: Sequence[TensorSpec],
    profiles: Sequence[Mapping[str, ShapeProfile]],
    precision: Precision | str = Precision.FP32,
    cache_dir: str | None = None,
    device_id: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """All TensorRT EP provider options for one session, as the strings ONNX Runtime parses.

    Args:
        inputs: the model's input specs.
        profiles: enginekit profiles (a repeated input in ``--shapes`` made several).
        precision: fp16/bf16/int8 turn on the EP's matching flag.
        cache_dir: engine and timing cache directory (``trt_engine_cache_*``,
            ``trt_timing_cache_*``); None disables caching.
        device_id: CUDA device ordinal.
        extra: raw EP options merged last (the onnxruntime backend's ``trt_options``).
    """
    options = {"device_id": str(device_id)}
    options.update(profile_shapes(inputs, profiles))
    flag = _PRECISION_FLAG.get(Precision(precision))
    if flag:
        options[flag] = "True"
    if cache_dir is not None:
        options.update(
            {
                "trt_engine_cache_enable": "True",
                "trt_engine_cache_path": str(cache_dir),
                "trt_timing_cache_enable": "True",
                "trt_timing_cache_path": str(cache_dir),
            }
        )
    for key, value in (extra or {}).items():
        options[str(key)] = _text(value)
    return options


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)
