"""XlaEngine: power-of-two batch buckets, padding, per-size programs for other dynamic dims."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

import xla_graphs as graphs
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit.backends.xla.runtime import bucket, pad_rows


def test_bucket_rounds_up_to_a_power_of_two_capped_by_the_largest_batch():
    assert [bucket(b, 16) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket(11, 12) == 12
    assert bucket(13, None) == 16


def test_pad_rows_repeats_the_last_row():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(pad_rows(a, 4), np.vstack([a, a[-1:]]))


def test_batches_one_to_max_compile_at_most_log2_max_plus_one_programs(mlp_path, tmp_path):
    shapes = {"x": [(1, 16), (8, 16), (16, 16)]}
    ek.build(
        mlp_path, backend="xla", shapes=shapes, output=tmp_path / "m.ekit", xla_flags="ynn-off"
    )
    engine = ek.load(tmp_path / "m.ekit")
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    want = reference(mlp_path, {"x": x})["output"]
    with graphs.counting_compiles() as compiles:
        for b in range(1, 17):
            got = engine.infer(x[:b])["output"]
            np.testing.assert_allclose(got, want[:b], rtol=1e-4, atol=1e-5)
    limit = int(math.log2(16)) + 1
    assert len(engine.programs) == limit
    assert len(compiles) == limit


def test_exact_buckets_compile_one_program_per_batch_size(mlp_path):
    engine = ek.build(
        mlp_path, backend="xla", shapes={"x": [(1, 16), (4, 16), (8, 16)]}, verify=False,
        buckets="exact", xla_flags="ynn-off",
    )  # fmt: skip
    with graphs.counting_compiles() as compiles:
        for b in (1, 2, 3, 3):
            engine.infer(np.ones((b, 16), np.float32))
    assert sorted(engine.programs) == ["1x16", "2x16", "3x16"]
    assert len(compiles) == 3


def test_rows_that_interact_turn_padding_off(tmp_path):
    path = ek.load_model(graphs.batch_mixing()).save(tmp_path / "mix.onnx")
    engine = ek.build(path, backend="xla", shapes={"x": [(1, 4), (4, 4), (8, 4)]})
    assert engine.manifest["backend"]["metadata"]["buckets"] == "exact"
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(engine.infer(x)["y"], x - x.mean(0, keepdims=True), atol=1e-6)


@pytest.mark.slow
def test_sequence_lengths_compile_on_demand_and_are_never_padded(onnx_model, tmp_path):
    path = onnx_model("transformer")
    spec = CASES["transformer"]
    engine = ek.build(path, backend="xla", shapes=spec.shapes, verify=False, xla_flags="ynn-off")
    assert engine.manifest["backend"]["metadata"]["symbolic_dims"]["ids"] == ["batch", "seq"]
    for batch, seq in ((2, 3), (2, 5), (1, 5), (2, 3)):
        feeds = spec.feeds(batch, seed=seq, seq=seq)
        got = engine.infer(feeds)["output"]
        np.testing.assert_allclose(got, reference(path, feeds)["output"], rtol=1e-3, atol=1e-4)
    assert sorted(engine.programs) == ["1x5, 1x5", "2x3, 2x3", "2x5, 2x5"]


def test_precompile_builds_every_bucket_when_the_engine_loads(mlp_path, tmp_path):
    shapes = {"x": [(1, 16), (8, 16), (8, 16)]}
    ek.build(
        mlp_path, backend="xla", shapes=shapes, output=tmp_path / "p.ekit", verify=False,
        xla_flags="ynn-off", precompile="buckets",
    )  # fmt: skip
    engine = ek.load(tmp_path / "p.ekit")
    assert sorted(engine.programs) == ["1x16", "2x16", "4x16", "8x16"]
