"""TVM static-shape specializations: which batch sizes are compiled, that infer runs them when
the shapes match and the dynamic module otherwise, results against ONNX Runtime, the artifact
round trip, a module that fails to compile is dropped, and bad option values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit.artifact import open_artifact
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

from enginekit.backends import tvm as tvm_backend
from enginekit.backends.tvm import specialize

MLP = CASES["mlp"]
#: Batch 1 and 4 are specialized; 2 and 6 run on the dynamic module.
SHAPES = {"x": [(1, 16), (4, 16), (8, 16)]}


@pytest.fixture(scope="module")
def mlp_path(onnx_model) -> Path:
    return onnx_model("mlp")


@pytest.fixture(scope="module")
def artifact(mlp_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tvm-static") / "mlp.ekit"
    ek.build(mlp_path, backend="tvm", shapes=SHAPES, specialize=[1, 4], output=out).close()
    return out


def _used(engine, feeds) -> str:
    """The module file infer runs ``feeds`` on."""
    lib = engine.library(feeds)
    if lib is engine._dynamic:
        return "model.so"
    (shapes,) = [s for s, module in engine._static.items() if module is lib]
    return f"model-static-b{shapes[0][0]}.so"


def test_the_specialized_batch_sizes_are_recorded(artifact):
    with ek.load(artifact) as engine:
        meta = engine.manifest["backend"]["metadata"]
        static = [m for m in meta["modules"] if m.get("specialized")]
        assert [m["file"] for m in static] == ["model-static-b1.so", "model-static-b4.so"]
        assert [m["shapes"] for m in static] == [{"x": [1, 16]}, {"x": [4, 16]}]
        assert all(m["verify_max_abs"] < 1e-4 for m in static)
        assert meta["specialized"]["batch_sizes"] == [1, 4]
        assert meta["specialized"]["notes"] == []
        assert engine.static_shapes == [{"x": (1, 16)}, {"x": (4, 16)}]
    info = tvm_backend.inspect(open_artifact(artifact))
    assert [m.get("specialized", False) for m in info["modules"]] == [False, True, True]
    assert info["specialized"]["batch_sizes"] == [1, 4]


@pytest.mark.parametrize(
    "batch, module",
    [(1, "model-static-b1.so"), (4, "model-static-b4.so"), (2, "model.so"), (6, "model.so")],
)
def test_infer_runs_the_static_module_when_shapes_match_and_the_dynamic_one_otherwise(
    artifact, mlp_path, batch, module
):
    with ek.load(artifact) as engine:  # a fresh load: the artifact round trip
        feeds = MLP.feeds(batch, seed=batch)
        assert _used(engine, feeds) == module
        np.testing.assert_allclose(
            engine.infer(feeds)["output"], reference(mlp_path, feeds)["output"], atol=1e-5
        )


@pytest.mark.parametrize("option", [{}, {"specialize": False}])
def test_a_batch_only_dynamic_model_or_specialize_false_builds_the_dynamic_module_only(
    mlp_path, option
):
    with ek.build(mlp_path, backend="tvm", shapes=SHAPES, **option) as engine:
        meta = engine.manifest["backend"]["metadata"]
        assert [m["file"] for m in meta["modules"]] == ["model.so"]
        assert meta["specialized"] is None and engine.static_shapes == []


@pytest.mark.slow
def test_a_transformer_runs_its_static_module_only_at_the_opt_sequence_length(onnx_model):
    case = CASES["transformer"]
    path = onnx_model("transformer")
    with ek.build(path, backend="tvm", shapes=case.shapes) as engine:  # auto
        assert engine.static_shapes == [
            {"ids": (1, 8), "mask": (1, 8)},
            {"ids": (4, 8), "mask": (4, 8)},
        ]
        for seq, module in ((8, "model-static-b4.so"), (6, "model.so")):
            feeds = case.feeds(4, seed=seq, seq=seq)
            assert _used(engine, feeds) == module
            got, want = engine.infer(feeds), reference(path, feeds)
            for name in want:
                np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=1e-4)


def _parse(value, ranges=((1, 8),), dims=("batch", 16), tuned=()):
    from types import SimpleNamespace

    from enginekit.config import ShapeProfile

    model = SimpleNamespace(inputs=[SimpleNamespace(name="x", shape=dims)])
    profiles = tuple(
        {"x": ShapeProfile(min=(lo, 16), opt=(hi, 16), max=(hi, 16))} for lo, hi in ranges
    )
    config = SimpleNamespace(profiles=profiles)
    return specialize.parse_specialize(value, model, config, ranges[0][1], tuned)


def test_parse_specialize():
    # auto: batch 1 and the opt batch where another dim (a sequence) is symbolic, else none
    assert _parse("auto") == () and _parse(None) == ()
    assert _parse("auto", dims=("batch", "seq")) == (1, 8)
    assert _parse("auto", ranges=((2, 8),), dims=("batch", "seq")) == (8,)  # 1 is outside
    assert _parse("auto", dims=("batch", "seq"), tuned=(8,)) == (1,)  # a tuned module serves 8
    assert _parse("auto", dims=(2, 16)) == ()  # every dim static: the dynamic one is static
    assert _parse([2, 3, 3]) == (2, 3)
    assert _parse(5) == (5,)
    assert _parse(False) == () and _parse([]) == ()
    with pytest.raises(BuildError, match=r"batch size 9 lies outside .*1\.\.8"):
        _parse([1, 9])
    with pytest.raises(BuildError, match="expected 'auto', False, a batch size"):
        _parse("yes")
    with pytest.raises(BuildError, match="positive"):
        _parse([0])


def test_a_module_that_fails_to_compile_is_dropped_with_a_note(mlp_path, monkeypatch):
    real = specialize.compile_library

    def fail_static(mod, target, opts, database, path):
        if path.name.startswith("model-static"):
            raise BuildError("simulated compile failure")
        return real(mod, target, opts, database, path)

    monkeypatch.setattr(specialize, "compile_library", fail_static)
    with ek.build(mlp_path, backend="tvm", shapes=SHAPES, specialize=[4]) as engine:
        meta = engine.manifest["backend"]["metadata"]
        assert [m["file"] for m in meta["modules"]] == ["model.so"]
        assert meta["specialized"]["batch_sizes"] == []
        assert "simulated compile failure" in meta["specialized"]["notes"][0]
        feeds = MLP.feeds(4, seed=0)
        np.testing.assert_allclose(
            engine.infer(feeds)["output"], reference(mlp_path, feeds)["output"], atol=1e-5
        )
