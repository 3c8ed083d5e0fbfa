"""One suite, every available backend: same models, same batches, same reference, same tolerance.

A backend that is not installed is skipped with the reason it gives; one without a CPU device runs
on its first CUDA device (TensorRT), or is skipped when it has neither.
Batches: 1, an odd size, the profile's max, and max + 3 (which Engine must split and re-join).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit import backends

ATOL, RTOL = 1e-4, 1e-3


def _backend_params() -> list:
    params = []
    for name in backends.names():
        avail = backends.availability(name)
        marks = []
        if not avail.available:
            marks.append(pytest.mark.skip(reason=f"{name} unavailable: {avail.reason}"))
        elif _device(name) is None:
            marks.append(
                pytest.mark.skip(reason=f"{name} has no CPU or CUDA device; {avail.devices}")
            )
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def _device(name: str) -> str | None:
    """The device the suite runs ``name`` on: CPU where it has one, else its first CUDA device."""
    devices = backends.availability(name).devices
    if "cpu" in devices:
        return "cpu"
    return next((d for d in devices if d.startswith("cuda")), None)


@pytest.fixture(scope="module")
def engines(onnx_model, tmp_path_factory):
    cache: dict[tuple[str, str], ek.Engine] = {}
    out = tmp_path_factory.mktemp("conformance")

    def get(backend: str, case: str) -> ek.Engine:
        key = (backend, case)
        if key not in cache:
            path = onnx_model(case)
            ek.build(
                path,
                backend=backend,
                shapes=CASES[case].shapes,
                device=_device(backend) or "cpu",
                output=out / f"{case}-{backend}.ekit",
            )
            cache[key] = ek.load(out / f"{case}-{backend}.ekit")
        return cache[key]

    yield get
    for engine in cache.values():
        engine.close()


@pytest.mark.parametrize("backend", _backend_params())
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_at_every_batch(backend, case, engines, onnx_model):
    engine = engines(backend, case)
    spec = CASES[case]
    for batch in (1, 5, spec.max_batch, spec.max_batch + 3):
        feeds = spec.feeds(batch, seed=batch)
        want = reference(onnx_model(case), feeds)
        got = engine.infer(feeds)
        assert list(got) == [o.name for o in engine.outputs]
        for name, w in want.items():
            assert got[name].shape == w.shape, (batch, name)
            np.testing.assert_allclose(
                got[name], w, atol=ATOL, rtol=RTOL, err_msg=f"{case} batch {batch} {name}"
            )


@pytest.mark.parametrize("backend", _backend_params())
def test_transformer_dynamic_sequence(backend, engines, onnx_model):
    engine = engines(backend, "transformer")
    spec = CASES["transformer"]
    for batch, seq in ((1, 2), (3, 7), (8, 12)):
        feeds = spec.feeds(batch, seed=seq, seq=seq)
        want = reference(onnx_model("transformer"), feeds)
        got = engine.infer(feeds)
        np.testing.assert_allclose(got["output"], want["output"], atol=ATOL, rtol=RTOL)
    with pytest.raises(ek.EngineInputError, match="seq|dim 1"):
        engine.infer(spec.feeds(2, seq=13))


@pytest.mark.parametrize("backend", _backend_params())
def test_sequence_and_single_array_forms_agree(backend, engines):
    engine = engines(backend, "two_input")
    feeds = CASES["two_input"].feeds(3)
    by_name = engine.infer(feeds)
    by_order = engine.infer([feeds["a"], feeds["b"]])
    for name in by_name:
        np.testing.assert_array_equal(by_name[name], by_order[name])
    mlp = engines(backend, "mlp")
    x = CASES["mlp"].feeds(2)["x"]
    np.testing.assert_array_equal(mlp.infer(x)["output"], mlp.infer({"x": x})["output"])
