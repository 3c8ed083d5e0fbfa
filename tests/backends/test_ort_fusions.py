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


def test_auto_skips_fusions_the_session_makes_itself_untimed(onnx_model):
    # The optimizer fuses only SkipLayerNormalization here, which the session's own optimizer
    # makes too: two equal graphs are not timed against each other.
    engine = ek.build(onnx_model("transformer"), shapes=SHAPES)
    record = _fusion_pass(engine)
    assert record is not None and record["fused"] == {"SkipLayerNormalization": 2}
    assert not record["kept"] and "itself" in record["why"] and "fused_ms" not in record
    assert record["session_fuses"] == {"SkipLayerNormalization": 2}
    assert engine.manifest["verify"]["passed"]


@pytest.mark.parametrize("plain_ms, kept", [(10.0, True), (5.05, False)])
def test_auto_times_fusions_the_session_lacks_and_keeps_the_faster(
    onnx_model, monkeypatch, plain_ms, kept
):
    proto = onnx.load(onnx_model("transformer"))
    original = proto.SerializeToString()
    clock = [0.0]  # a fake clock: each run advances it by its session's time
    monkeypatch.setattr(ort_fusions.time, "perf_counter", lambda: clock[0])

    class Session:
        def __init__(self, data: bytes) -> None:
            self.ms = plain_ms if data == original else 5.0

        def run(self, _outputs: object, _feeds: object) -> None:
            clock[0] += self.ms / 1e3

    data, record = ort_fusions.choose(
        proto, "auto", Session, feeds={}, session_ops=lambda _: collections.Counter()
    )
    detail = record.to_json()
    assert detail["session_fuses"] == {"SkipLayerNormalization": 0}
    assert detail["kept"] is kept and "measured" in detail["why"]
    assert detail["unfused_ms"] == pytest.approx(plain_ms) and detail["fused_ms"] == 5.0
    assert (data != original) is kept


def test_non_transformer_graphs_and_off_are_left_alone(onnx_model, mlp_path):
    assert _fusion_pass(ek.build(mlp_path)) is None
    engine = ek.build(onnx_model("transformer"), shapes=SHAPES, transformer_fusions="off")
    assert _fusion_pass(engine) is None


def test_bad_value_suggests_the_closest(mlp_path):
    with pytest.raises(BuildError, match="did you mean 'bert'"):
        ek.build(mlp_path, transformer_fusions="bret")
