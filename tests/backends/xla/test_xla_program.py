"""StableHLO programs: symbolic dims, serialization, per-shape compiles, HLO summaries."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")

from enginekit.backends.xla import program  # noqa: E402
from enginekit.config import ShapeProfile  # noqa: E402
from enginekit.engine import TensorSpec  # noqa: E402
from enginekit.errors import ArtifactError  # noqa: E402

SPECS = [
    TensorSpec("ids", "int64", ("batch", "seq")),
    TensorSpec("mask", "float32", ("batch", "seq")),
    TensorSpec("img", "float32", ("?", 3)),
]


def test_symbolic_dims_keep_the_model_names_and_pin_dims_the_profiles_fix():
    ranged = ShapeProfile((1, 2), (4, 8), (8, 12))
    profiles = ({"ids": ranged, "mask": ranged, "img": ShapeProfile.fixed((2, 3))},)
    dims = program.symbolic_dims(SPECS, profiles)
    assert dims == {"ids": ["batch", "seq"], "mask": ["batch", "seq"], "img": [2, 3]}


def test_unnamed_dynamic_dims_get_a_name_per_input_and_axis():
    assert program.symbolic_dims(SPECS, ())["img"] == ["img_0", 3]


def _double_plus(weights, inputs):
    (w,) = weights
    (x,) = inputs
    return (jax.numpy.tanh(x * 2.0 + w),)


def test_program_round_trips_through_bytes_and_compiles_per_shape():
    w = np.ones(4, np.float32)
    spec = [TensorSpec("x", "float32", ("batch", 4))]
    exported = program.export(_double_plus, (w,), spec, {"x": ["batch", 4]}, "cpu")
    loaded = program.deserialize(program.serialize(exported))
    for rows in (1, 3):
        run, seconds = program.compile(loaded, (w,), [(rows, 4)], [np.dtype(np.float32)], {})
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        np.testing.assert_allclose(np.asarray(run((w,), (x,))[0]), np.tanh(x * 2 + 1), rtol=1e-6)
        assert seconds > 0


def test_garbage_bytes_are_an_artifact_error():
    with pytest.raises(ArtifactError, match="StableHLO payload cannot be read"):
        program.deserialize(b"definitely not a program")


def test_hlo_summary_counts_the_fusions_xla_made():
    w = np.ones(4, np.float32)
    spec = [TensorSpec("x", "float32", (2, 4))]
    exported = program.export(_double_plus, (w,), spec, {"x": [2, 4]}, "cpu")
    run, _ = program.compile(exported, (w,), [(2, 4)], [np.dtype(np.float32)], {})
    summary = program.hlo_summary(run)
    assert summary["fusions"] == 1  # mul, add and tanh in one loop fusion
    assert summary["fusion_kinds"] == {"kLoop": 1}


def _export_from_here():
    spec = [TensorSpec("x", "float32", ("batch", 4))]
    return program.serialize(
        program.export(_double_plus, (np.ones(4, np.float32),), spec, {"x": ["batch", 4]}, "cpu")
    )


def test_program_bytes_do_not_depend_on_or_reveal_the_call_site():
    first = _export_from_here()
    second = (lambda: _export_from_here())()  # another call stack
    assert first == second
    assert b"_export_from_here" not in first  # the callers' frames are not recorded
