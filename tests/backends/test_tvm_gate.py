"""A tuned module serves its batch only when timed faster than the dynamic module
(enginekit/backends/tvm/gate.py): the decision from two times, the interleaved timing, and a
build whose tuned module loses keeping it out of dispatch."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit.errors import BuildError

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

from enginekit.backends.tvm import gate

CNN = CASES["cnn"]


def test_a_tuned_module_slower_than_the_dynamic_one_is_not_served():
    served, decision = gate.decide(5.35, 5.17)
    assert not served
    assert decision == "not served: dynamic module faster, 5.35 ms vs 5.17"


def test_a_tuned_module_within_the_margin_is_not_served_and_one_beyond_it_is():
    served, decision = gate.decide(5.10, 5.17)  # 1.4% faster: within the 2% margin
    assert not served and decision.startswith("not served: within 2% of the dynamic module")
    served, decision = gate.decide(4.90, 5.17)
    assert served and decision == "served: 1.06x faster, 4.90 ms vs 5.17"
    assert gate.decide(5.10, 5.17, margin=0.01)[0]


def test_serve_always_or_untimed_modules_are_served():
    assert gate.decide(9.0, 5.0, serve="always") == (True, "served (serve='always')")
    served, decision = gate.decide(None, None)
    assert served and "not timed" in decision


def test_interleaved_timing_orders_a_slower_call_after_a_faster_one():
    fast, slow = gate.time_calls(
        [lambda: time.sleep(0.001), lambda: time.sleep(0.004)], rounds=3, round_s=0.02
    )
    assert 0.5 < fast < slow and slow / fast > 2


@pytest.mark.parametrize(
    ("tune", "message"),
    [
        ({"trials": 4, "serve": "never"}, "serve='never'"),
        ({"trials": 4, "margin": 1.5}, "margin=1.5"),
        ({"trials": 4, "margin": True}, "margin=True"),
    ],
)
def test_bad_serve_or_margin_is_refused(tune, message):
    from enginekit.backends.tvm.tune import parse_tune

    with pytest.raises(BuildError, match=message):
        parse_tune(tune, 1)


@pytest.mark.slow
def test_a_tuned_module_that_loses_is_left_out_and_the_dynamic_module_serves_its_batch(
    onnx_model, tmp_path
):
    path = onnx_model("cnn")
    # A margin of 0.99 asks the tuned module for 100x the dynamic module's speed: never met,
    # so the decision is the one a slower tuned module gets, without depending on the host.
    tune = {"trials": 4, "batch_sizes": [4], "margin": 0.99}
    engine = ek.build(
        path, backend="tvm", shapes=CNN.shapes, tune=tune, specialize=False,
        output=tmp_path / "a.ekit",
    )  # fmt: skip
    meta = engine.manifest["backend"]["metadata"]
    decision = meta["tuning"]["serving"]["4"]
    assert decision["served"] is False and decision["decision"].startswith("not served")
    assert decision["tuned_ms"] > 0 and decision["dynamic_ms"] > 0
    assert [m["file"] for m in meta["modules"]] == ["model.so"]
    assert "model-b4.so" not in engine.manifest["payload"]
    assert engine.static_shapes == []
    feeds = CNN.feeds(4, seed=4)
    np.testing.assert_allclose(
        engine.infer(feeds)["output"], reference(path, feeds)["output"], atol=1e-4, rtol=1e-3
    )
    engine.close()
    details = ek.backends.get("tvm").inspect(ek.artifact.open_artifact(tmp_path / "a.ekit"))
    assert details["serving"] == {"batch 4": decision["decision"]}


@pytest.mark.slow
def test_serve_always_keeps_the_tuned_module_in_dispatch_untimed(onnx_model, tmp_path, capsys):
    from enginekit.cli import main

    out = tmp_path / "b.ekit"
    code = main(
        ["build", str(onnx_model("cnn")), "--backend", "tvm", "-o", str(out), "--shapes",
         "x:1x3x16x16,4x3x16x16,8x3x16x16", "-O", "specialize=false", "-O",
         'tune={"trials": 4, "batch_sizes": [4], "serve": "always"}']
    )  # fmt: skip
    assert code == 0
    assert "tuned batch 4: served (serve='always')" in capsys.readouterr().out
    engine = ek.load(out)
    assert engine.static_shapes == [{"x": (4, 3, 16, 16)}]
    serving = engine.manifest["backend"]["metadata"]["tuning"]["serving"]["4"]
    assert serving["tuned_ms"] is None and serving["served"] is True
    engine.close()
