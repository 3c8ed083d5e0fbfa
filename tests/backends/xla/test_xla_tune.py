"""Build-time measurement of layouts and XLA option sets; the batch-padding probe."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")

from enginekit.backends.xla import program, tune  # noqa: E402
from enginekit.engine import TensorSpec  # noqa: E402

SPEC = [TensorSpec("x", "float32", ("batch", 4))]


def _export(fn):
    return program.export(fn, (), SPEC, {"x": ["batch", 4]}, "cpu")


def _rowwise(weights, inputs):
    return (jax.numpy.tanh(inputs[0]) * 2,)


def _batch_mixing(weights, inputs):
    x = inputs[0]
    return (x - x.mean(axis=0, keepdims=True),)


def test_measure_times_every_layout_and_flag_set_pair():
    exported = _export(_rowwise)
    x = np.ones((4, 4), np.float32)
    trials = tune.measure(
        {"nhwc": (exported, ()), "nchw": (exported, ())}, tune.FLAG_SETS, [x], budget_s=0.05
    )
    assert {(t.layout, t.flags) for t in trials} == {
        (lay, f) for lay in ("nhwc", "nchw") for f in tune.FLAG_SETS
    }
    assert all(t.ms > 0 and t.compile_s > 0 for t in trials)
    assert tune.best(trials).ms == min(t.ms for t in trials)


def test_padding_probe_tells_independent_rows_from_interacting_ones():
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    assert tune.rows_independent(_export(_rowwise), (), [x], {})
    assert not tune.rows_independent(_export(_batch_mixing), (), [x], {})
