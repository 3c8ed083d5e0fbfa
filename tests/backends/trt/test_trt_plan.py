"""TensorRT build planning (enginekit/backends/tensorrt/plan.py): runs without TensorRT or a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import trt_models

from enginekit.backends.tensorrt import plan
from enginekit.config import BuildConfig, ShapeProfile, normalize_shapes, parse_shapes
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError
from enginekit.model import load_model

X = TensorSpec("x", "float32", ("batch", 3, 224, 224))
IDS = TensorSpec("ids", "int64", ("batch", "seq"))
MASK = TensorSpec("mask", "float32", ("batch", "seq"))
SCALE = TensorSpec("scale", "float32", (1,))


def sp(lo, mid, hi) -> ShapeProfile:
    return ShapeProfile(tuple(lo), tuple(mid), tuple(hi))


# -- profiles ------------------------------------------------------------------------------------


def test_profiles_are_completed_with_the_fixed_shape_of_static_inputs():
    profiles = plan.plan_profiles(
        [X, SCALE], [{"x": sp((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}]
    )
    assert list(profiles[0]) == ["x", "scale"]
    assert profiles[0]["scale"] == ShapeProfile.fixed((1,))


def test_repeated_shapes_flag_makes_two_profiles_that_plan_accepts():
    profiles = parse_shapes(
        ["x:1x3x224x224,8x3x224x224,32x3x224x224", "x:33x3x224x224,64x3x224x224,128x3x224x224"]
    )
    planned = plan.plan_profiles([X], profiles)
    assert [p["x"].max[0] for p in planned] == [32, 128]


def test_dynamic_input_left_out_of_a_profile_is_named_with_its_dim():
    with pytest.raises(
        BuildError, match=r"profile 1 gives no shapes for input 'mask', whose dim 0"
    ):
        plan.plan_profiles(
            [IDS, MASK],
            [
                {"ids": sp((1, 2), (4, 8), (8, 12)), "mask": sp((1, 2), (4, 8), (8, 12))},
                {"ids": sp((1, 2), (4, 8), (8, 12))},
            ],
        )


def test_dynamic_input_missing_from_every_profile_is_named():
    with pytest.raises(BuildError, match=r"input 'mask', whose dim 0 is dynamic \('batch'\)"):
        plan.plan_profiles([IDS, MASK], [{"ids": sp((1, 2), (4, 8), (8, 12))}])


def test_dynamic_model_without_profiles_asks_for_shapes():
    with pytest.raises(BuildError, match=r"input 'x' dim 0 is dynamic .*--shapes x:1x3x224x224"):
        plan.plan_profiles([X], [])


def test_static_model_needs_no_profile():
    assert plan.plan_profiles([SCALE], []) == ()


def test_unknown_input_is_named_with_the_real_ones():
    with pytest.raises(BuildError, match=r"profile 0 names input 'y'.*inputs: x"):
        plan.plan_profiles([X], [{"y": sp((1,), (2,), (3,))}])


def test_wrong_rank_names_input():
    with pytest.raises(BuildError, match=r"profile 0, input 'x': shapes of rank 2"):
        plan.plan_profiles([X], [{"x": sp((1, 3), (2, 3), (4, 3))}])


def test_profile_contradicting_a_fixed_dim_names_input_and_dim():
    with pytest.raises(BuildError, match=r"input 'x' dim 1: the model fixes it to 3"):
        plan.plan_profiles([X], [{"x": sp((1, 4, 224, 224), (2, 4, 224, 224), (4, 4, 224, 224))}])


def test_profiles_covering_different_inputs_are_refused():
    scale = sp((1,), (1,), (1,))
    x = sp((1, 3, 224, 224), (2, 3, 224, 224), (4, 3, 224, 224))
    with pytest.raises(BuildError, match=r"input 'scale' is in profile 1 but not in profile 0"):
        plan.plan_profiles([X, SCALE], [{"x": x}, {"x": x, "scale": scale}])


def test_min_above_opt_names_input_and_dim():
    with pytest.raises(
        BuildError, match=r"input 'x'.*dim 0 needs 0 <= min <= opt <= max, got 8, 4"
    ):
        normalize_shapes({"x": [(8, 3, 224, 224), (4, 3, 224, 224), (32, 3, 224, 224)]})
    with pytest.raises(BuildError, match=r"input 'x'.*dim 0"):
        parse_shapes("x:8x3x224x224,4x3x224x224,32x3x224x224")


def test_inputs_sharing_a_symbolic_dim_must_get_the_same_range():
    with pytest.raises(
        BuildError, match=r"'ids' dim 1 and 'mask' dim 1 share the dynamic dim 'seq'"
    ):
        plan.plan_profiles(
            [IDS, MASK],
            [{"ids": sp((1, 2), (4, 8), (8, 12)), "mask": sp((1, 2), (4, 8), (8, 16))}],
        )


@pytest.mark.parametrize(
    ("batch", "want"),
    [(1, 0), (32, 0), (33, 1), (128, 1), (129, None)],
)
def test_profile_is_chosen_by_the_range_holding_the_shape(batch, want):
    profiles = plan.plan_profiles([X], parse_shapes(
        ["x:1x3x224x224,8x3x224x224,32x3x224x224", "x:33x3x224x224,64x3x224x224,128x3x224x224"]
    ))  # fmt: skip
    assert plan.select_profile(profiles, {"x": (batch, 3, 224, 224)}) == want


def test_overlapping_profiles_pick_the_nearest_opt_then_the_lower_index():
    a = {"x": sp((1, 4), (2, 4), (64, 4))}
    b = {"x": sp((1, 4), (48, 4), (64, 4))}
    assert plan.select_profile([a, b], {"x": (40, 4)}) == 1
    assert plan.select_profile([a, b], {"x": (3, 4)}) == 0
    assert plan.select_profile([a, a], {"x": (3, 4)}) == 0
    assert plan.select_profile([], {"x": (3, 4)}) == 0


# -- sizes and options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [(4096, 4096), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 * 10**9), ("1.5kb", 1500)],
)
def test_sizes_parse_with_units(text, want):
    assert plan.parse_size(text) == want


@pytest.mark.parametrize("bad", ["four", "-1", -1, True, "4XB"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(BuildError, match="workspace"):
        plan.parse_size(bad, "workspace")


def test_memory_pools_combine_workspace_and_named_pools():
    pools = plan.memory_pools(
        {"workspace": "1GiB", "memory_pools": {"tactic_shared_memory": "48KiB"}}
    )
    assert pools == {"TACTIC_SHARED_MEMORY": 48 << 10, "WORKSPACE": 1 << 30}
    with pytest.raises(BuildError, match="no TensorRT memory pool 'vram'"):
        plan.memory_pools({"memory_pools": {"vram": 1}})


# -- precision -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "gen", "typed", "rewrite", "flags", "net"),
    [
        ("fp32", 10, None, "none", (), ()),
        ("fp32", 11, None, "none", (), ()),
        ("fp16", 10, None, "none", ("FP16",), ()),
        ("bf16", 10, None, "none", ("BF16",), ()),
        ("fp16", 10, True, "fp16", (), ("STRONGLY_TYPED",)),
        ("fp16", 11, None, "fp16", (), ()),
        ("bf16", 11, None, "bf16", (), ()),
    ],
)
def test_precision_plan_per_tensorrt_generation(precision, gen, typed, rewrite, flags, net):
    p = plan.plan_precision(precision, gen, strongly_typed=typed)
    assert (p.rewrite, p.builder_flags, p.network_flags) == (rewrite, flags, net)
    assert p.cleared_flags == ("TF32",)
    assert p.strongly_typed == (gen == 11 or bool(typed))


def test_int8_plan_uses_the_qdq_model_and_the_int8_flag_only_on_tensorrt_10():
    ten = plan.plan_precision("int8", 10, has_quantizer=True)
    eleven = plan.plan_precision("int8", 11, has_quantizer=True)
    assert (ten.rewrite, ten.builder_flags) == ("qdq", ("INT8",))
    assert (eleven.rewrite, eleven.builder_flags, eleven.strongly_typed) == ("qdq", (), True)
    assert plan.plan_precision("int8", 11, model_has_qdq=True).rewrite == "none"


def test_int8_without_a_qdq_model_says_how_to_get_one():
    with pytest.raises(BuildError, match="needs a Q/DQ model.*qdq_model"):
        plan.plan_precision("int8", 10)


def test_qdq_model_at_another_precision_is_refused():
    with pytest.raises(BuildError, match="QuantizeLinear/DequantizeLinear.*fp16"):
        plan.plan_precision("fp16", 11, model_has_qdq=True)


def test_weak_typing_cannot_be_asked_of_tensorrt_11():
    with pytest.raises(BuildError, match="TensorRT 11 has no weakly typed networks"):
        plan.plan_precision("fp16", 11, strongly_typed=False)


def test_tf32_stays_on_when_asked():
    assert plan.plan_precision("fp32", 10, tf32=True).cleared_flags == ()


@pytest.mark.parametrize(
    ("version", "gen"), [("10.0.1.6", 10), ("10.13.3.9", 10), ("11.0.0", 11), ("12.1", 11)]
)
def test_generation_from_version(version, gen):
    assert plan.generation(version) == gen


def test_tensorrt_8_is_refused():
    with pytest.raises(BuildError, match="too old"):
        plan.generation("8.6.1")


# -- the whole plan ------------------------------------------------------------------------------


def mlp_config(**options) -> tuple:
    model = load_model(trt_models.mlp())
    config = BuildConfig(
        backend="tensorrt",
        profiles=normalize_shapes({"x": [(1, 16), (8, 16), (64, 16)]}),
        precision="fp16",
        device="cuda",
        options=options,
    )
    return model, config


def test_build_plan_collects_everything_and_is_json():
    import json

    model, config = mlp_config(workspace="2GiB", builder_optimization_level=4, timing_cache="c/")
    p = plan.plan_build(model, config, "10.8.0.43")
    assert (p.generation, p.precision.builder_flags, p.memory_pools) == (
        10,
        ("FP16",),
        {"WORKSPACE": 2 << 30},
    )
    assert p.builder_optimization_level == 4 and p.timing_cache == "c/"
    assert json.loads(json.dumps(p.to_json()))["profiles"][0]["x"] == [[1, 16], [8, 16], [64, 16]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"builder_optimization_level": 7}, "builder_optimization_level"),
        ({"hardware_compatibility": "turing_plus"}, "hardware_compatibility"),
        ({"fp32_ops": "Pow"}, "fp32_ops"),
        ({"qdq_model": "/nonexistent/q.onnx"}, "qdq_model"),
        ({"strongly_typed": "maybe"}, "strongly_typed"),
    ],
)
def test_bad_options_are_refused_before_building(options, message):
    model, config = mlp_config(**options)
    with pytest.raises(BuildError, match=message):
        plan.plan_build(model, config, "10.8.0.43")


# -- build key -----------------------------------------------------------------------------------


def test_build_key_changes_when_and_only_when_an_input_changes():
    model, config = mlp_config(workspace="1GiB")
    key = plan.build_key(model, config, "10.8.0.43", "9.0")
    same = [
        plan.build_key(load_model(trt_models.mlp()), config, "10.8.0.43", "9.0"),
        plan.build_key(model, dataclasses.replace(config, options={"workspace": "1GiB", "timing_cache": "a.cache"}), "10.8.0.43", "9.0"),
        plan.build_key(model, dataclasses.replace(config, options={"check_ops": False, "workspace": "1GiB"}), "10.8.0.43", "9.0"),
    ]  # fmt: skip
    assert all(k == key for k in same)
    changed = [
        plan.build_key(load_model(trt_models.mlp(seed=1)), config, "10.8.0.43", "9.0"),
        plan.build_key(model, dataclasses.replace(config, precision="fp32"), "10.8.0.43", "9.0"),
        plan.build_key(model, dataclasses.replace(config, profiles=normalize_shapes({"x": [(1, 16), (8, 16), (32, 16)]})), "10.8.0.43", "9.0"),
        plan.build_key(model, dataclasses.replace(config, options={"workspace": "2GiB"}), "10.8.0.43", "9.0"),
        plan.build_key(model, config, "10.9.0.34", "9.0"),
        plan.build_key(model, config, "10.8.0.43", "8.6"),
        plan.build_key(model, config, "10.8.0.43", "9.0", calibration="ab" * 32),
    ]  # fmt: skip
    assert len({key, *changed}) == len(changed) + 1


# -- timing cache ----------------------------------------------------------------------------------


def test_timing_cache_file_is_keyed_by_tensorrt_version_and_gpu(tmp_path):
    a = plan.timing_cache_path(tmp_path / "trt.cache", "10.8.0.43", "NVIDIA H200", "9.0")
    assert a == tmp_path / "trt.trt10.8.0.43-sm90-nvidia-h200.cache"
    others = {
        plan.timing_cache_path(tmp_path / "trt.cache", "10.9.0.34", "NVIDIA H200", "9.0"),
        plan.timing_cache_path(tmp_path / "trt.cache", "10.8.0.43", "NVIDIA A10", "8.6"),
    }
    assert a not in others and len(others) == 2


def test_timing_cache_directory_holds_one_file_per_key(tmp_path):
    got = plan.timing_cache_path(tmp_path, "11.0.0", "NVIDIA L4", "8.9")
    assert got == tmp_path / "trt11.0.0-sm89-nvidia-l4.cache"
    assert plan.timing_cache_path("caches/", "11.0.0", "NVIDIA L4", "8.9").parent.name == "caches"
