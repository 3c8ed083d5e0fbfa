"""ONNX Runtime's transformer fusions at build time: applied to encoder graphs where measured
faster, recorded in the manifest's passes, verified, and off on request."""

from __future__ import annotations

import collections

import onnx
import pytest
from models import CASES

import enginekit as ek
from enginekit.backends import ort_fusions
from enginekit.errors import BuildError

SHAPES = CASES["transformer"].shapes


def _fusion_pass(engine: ek.Engine) -> dict | None:
    found = [p for p in engine.manifest["passes"] if p["name"] == "transformer_fusions"]
    return found[0] if found else None


def test_forced_fusions_rewrite_the_encoder_into_fused_ops_and_verify(onnx_model, tmp_path):
    path = tmp_path / "enc.ekit"
    engine = ek.build(onnx_model("transformer"), shapes=SHAPES, transformer_fusions="bert",
                      output=path)  # fmt: skip
    record = _fusion_pass(engine)
    assert record["kept"] and record["model_type"] == "bert" and record["fused"]
    assert record["nodes_after"] < record["nodes_before"]
    assert engine.manifest["verify"]["passed"]
    payload = onnx.load_from_string(ek.load(path).artifact.read("model.onnx"))
    domains = collections.Counter(n.domain for n in payload.graph.node)
    assert domains["com.microsoft"] > 0


def test_auto_times_both_graphs_and_keeps_the_faster(onnx_model):
    engine = ek.build(onnx_model("transformer"), shapes=SHAPES)
    record = _fusion_pass(engine)
    assert record is not None and record["fused"]
    assert record["kept"] == (record["unfused_ms"] >= record["fused_ms"] * ort_fusions.MIN_GAIN)
    assert "measured" in record["why"]
    assert engine.manifest["verify"]["passed"]


def test_non_transformer_graphs_and_off_are_left_alone(onnx_model, mlp_path):
    assert _fusion_pass(ek.build(mlp_path)) is None
    engine = ek.build(onnx_model("transformer"), shapes=SHAPES, transformer_fusions="off")
    assert _fusion_pass(engine) is None


def test_bad_value_suggests_the_closest(mlp_path):
    with pytest.raises(BuildError, match="did you mean 'bert'"):
        ek.build(mlp_path, transformer_fusions="bret")
