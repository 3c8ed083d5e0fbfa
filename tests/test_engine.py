"""Engine: input validation, empty and oversized batches, concurrency, async, close."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
from conftest import reference
from models import CASES

import enginekit as ek


@pytest.fixture(scope="module")
def mlp(onnx_model):
    engine = ek.build(onnx_model("mlp"), shapes=CASES["mlp"].shapes)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def two(onnx_model):
    engine = ek.build(onnx_model("two_input"), shapes=CASES["two_input"].shapes)
    yield engine
    engine.close()


def x(rows: int, cols: int = 16) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)


def test_specs_have_symbolic_batch(mlp):
    assert mlp.inputs == (ek.TensorSpec("x", "float32", ("batch", 16)),)
    assert mlp.outputs == (ek.TensorSpec("output", "float32", ("batch", 4)),)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"y": x(2)}, "missing input.*'x'.*unknown input.*'y'"),
        ({}, "missing input.*'x'"),
        ({"x": x(2), "extra": x(2)}, "unknown input.*'extra'"),
        ({"x": x(2).astype(np.float64)}, "'x'.*expected dtype float32, got float64"),
        ({"x": x(2).astype(np.float16)}, "expected dtype float32, got float16"),
        ({"x": x(2)[None]}, "'x'.*expected rank 2.*got rank 3"),
        ({"x": x(2, 17)}, "'x'.*dim 1 must be 16.*got shape \\(2, 17\\)"),
        ([x(2), x(2)], "expected 1 inputs in order \\(x\\), got a sequence of 2"),
        ("not an array", "expected an array.*got str"),
    ],
)
def test_bad_inputs_raise_engine_input_error_naming_the_input(mlp, batch, message):
    with pytest.raises(ek.EngineInputError, match=message):
        mlp.infer(batch)


def test_single_array_refused_for_two_input_model(two):
    with pytest.raises(ek.EngineInputError, match="2 inputs \\(a, b\\)"):
        two.infer(x(2, 8))


def test_inputs_sharing_batch_dim_must_agree(two):
    with pytest.raises(ek.EngineInputError, match="share dim 'batch'"):
        two.infer({"a": x(2, 8), "b": x(3, 4)})


def test_dim_outside_every_profile_is_refused(onnx_model):
    engine = ek.build(onnx_model("transformer"), shapes=CASES["transformer"].shapes)
    feeds = CASES["transformer"].feeds(2, seq=13)
    with pytest.raises(ek.EngineInputError, match="'ids' dim 1 is 13, built for 2..12"):
        engine.infer(feeds)


def test_batch_below_profile_min_is_padded_and_trimmed(onnx_model):
    path = onnx_model("mlp")
    engine = ek.build(path, shapes={"x": [(4, 16), (4, 16), (8, 16)]})
    got = engine.infer(x(11))["output"]  # 8 + 3 rows: the 3-row chunk is padded to 4
    np.testing.assert_allclose(got, reference(path, {"x": x(11)})["output"], atol=1e-5)
    assert got.shape == (11, 4)
    small = engine.infer(x(1))["output"]  # a whole batch below the minimum: padded the same way
    np.testing.assert_allclose(small, reference(path, {"x": x(1)})["output"], atol=1e-5)
    assert small.shape == (1, 4)


def test_infer_splits_batch_larger_than_profile(mlp, mlp_path):
    batch = x(16 * 3 + 5)
    got = mlp.infer(batch)["output"]
    np.testing.assert_allclose(got, reference(mlp_path, {"x": batch})["output"], atol=1e-5)


def test_empty_batch_returns_empty_outputs(mlp, two):
    out = mlp.infer(np.zeros((0, 16), np.float32))
    assert out["output"].shape == (0, 4) and out["output"].dtype == np.float32
    out = two.infer({"a": np.zeros((0, 8), np.float32), "b": np.zeros((0, 4), np.float32)})
    assert [v.shape for v in out.values()] == [(0, 6), (0, 1)]


def test_nan_passes_through(mlp):
    batch = x(3)
    batch[1, :] = np.nan
    got = mlp.infer(batch)["output"]
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def test_accepts_torch_tensors_through_dlpack(mlp):
    torch = pytest.importorskip("torch")
    batch = x(3)
    np.testing.assert_array_equal(
        mlp.infer(torch.from_numpy(batch))["output"], mlp.infer(batch)["output"]
    )
    np.testing.assert_array_equal(
        mlp.infer({"x": torch.from_numpy(batch)})["output"], mlp.infer(batch)["output"]
    )
    with pytest.raises(ek.EngineInputError, match="float64"):
        mlp.infer(torch.zeros(3, 16, dtype=torch.float64))


def test_non_contiguous_views_are_accepted(mlp):
    batch = x(6, 32)[:, ::2]
    np.testing.assert_allclose(mlp.infer(batch)["output"], mlp.infer(batch.copy())["output"])


def test_eight_threads_match_serial_results(mlp):
    batches = [x(n % 16 + 1) for n in range(64)]
    serial = [mlp.infer(b)["output"] for b in batches]
    barrier = threading.Barrier(8)

    def work(i: int) -> list[np.ndarray]:
        barrier.wait()
        return [mlp.infer(batches[j])["output"] for j in range(i, len(batches), 8)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    for i, chunk in enumerate(results):
        for j, got in zip(range(i, len(batches), 8), chunk):
            np.testing.assert_array_equal(got, serial[j])


def test_infer_async_returns_future(mlp):
    batch = x(5)
    future = mlp.infer_async(batch)
    np.testing.assert_array_equal(future.result(timeout=30)["output"], mlp.infer(batch)["output"])


def test_closed_engine_refuses_work(onnx_model):
    with ek.build(onnx_model("mlp")) as engine:
        engine.infer(x(1))
    with pytest.raises(ek.EnginekitError, match="closed"):
        engine.infer(x(1))
    engine.close()  # closing twice is harmless
