"""BuildConfig, ShapeProfile and the trtexec-style --shapes syntax."""

from __future__ import annotations

import dataclasses

import pytest

import enginekit as ek
from enginekit.config import normalize_shapes


def test_parse_shapes_profile_and_fixed():
    profiles = ek.parse_shapes("x:1x16,8x16,64x16 y:4x2")
    assert profiles == (
        {"x": ek.ShapeProfile((1, 16), (8, 16), (64, 16)), "y": ek.ShapeProfile.fixed((4, 2))},
    )


def test_repeated_input_adds_a_profile():
    profiles = ek.parse_shapes(["x:1x3,2x3,4x3", "x:5x3,6x3,8x3"])
    assert [p["x"].max for p in profiles] == [(4, 3), (8, 3)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "expected name:AxB"),
        ("x:1x16,8x16", "must be one shape"),
        ("x:1xa", "not a shape"),
        ("x:8x16,4x16,16x16", "dim 0 needs 0 <= min <= opt <= max, got 8, 4, 16"),
        ("x:1x16,1x16x2,1x16", "same rank"),
    ],
)
def test_bad_shape_specs_raise_build_error(text, message):
    with pytest.raises(ek.BuildError, match=message):
        ek.parse_shapes(text)


def test_normalize_accepts_every_documented_form():
    want = ({"x": ek.ShapeProfile((1, 16), (8, 16), (64, 16))},)
    assert normalize_shapes({"x": [(1, 16), (8, 16), (64, 16)]}) == want
    assert normalize_shapes({"x": "1x16,8x16,64x16"}) == want
    assert normalize_shapes("x:1x16,8x16,64x16") == want
    assert normalize_shapes([{"x": [(1, 16), (8, 16), (64, 16)]}]) == want
    assert normalize_shapes({"x": (8, 16)}) == ({"x": ek.ShapeProfile.fixed((8, 16))},)
    assert normalize_shapes(None) == ()


def test_config_round_trips_through_json():
    config = ek.BuildConfig(
        profiles=normalize_shapes({"x": [(1, 16), (8, 16), (64, 16)]}),
        precision="fp16",
        atol=0.5,
        options={"intra_op_threads": 2},
    )
    assert ek.BuildConfig.from_json(config.to_json()) == config
    assert config.tolerance == (0.5, 2e-2)  # the scaled rule's fp16 rtol, atol as given
    assert dataclasses.replace(config, rule="elementwise").tolerance == (0.5, 1e-2)


@pytest.mark.parametrize(("field", "value"), [("precision", "int4"), ("device", "tpu")])
def test_config_rejects_unknown_values(field, value):
    with pytest.raises(ek.BuildError, match=value):
        ek.BuildConfig(**{field: value})
