"""The batcher's dispatch policy (cost model, arrivals, decide, preferred sizes) and metrics."""

from __future__ import annotations

import math
import re

import pytest

import enginekit as ek
from enginekit.batcher.policy import ArrivalRate, CostModel, decide, pow2_sizes, take_size

from .batcher_engines import build, rows


def test_cost_model_recovers_fixed_and_per_row_time():
    model = CostModel()
    for n in (1, 8, 16, 4, 32, 1, 8):
        model.observe(n, 1e-3 + 2e-4 * n)
    assert model.fixed == pytest.approx(1e-3, rel=1e-6)
    assert model.per_row == pytest.approx(2e-4, rel=1e-6)
    assert model.predict(10) == pytest.approx(3e-3, rel=1e-6)


def test_cost_model_with_one_batch_size_assumes_no_per_row_cost():
    model = CostModel()
    model.observe(1, 0.004)
    model.observe(1, 0.002)
    assert model.per_row == 0.0 and model.fixed == pytest.approx(0.003, rel=0.05)


def cost(fixed: float, per_row: float) -> CostModel:
    model = CostModel()
    for n in (1, 2):
        model.observe(n, fixed + per_row * n)
    return model


def test_full_and_expired_windows_send():
    model, rate = cost(1e-3, 1e-4), ArrivalRate()
    assert decide(8, 8, 0.0, 0.0, 0.01, rate, model).reason == "full"
    assert decide(1, 8, 0.0, 0.011, 0.01, None, model).reason == "window"
    waiting = decide(1, 8, 0.0, 0.005, 0.01, None, model)
    assert not waiting.send and waiting.recheck_at == pytest.approx(0.01)


def test_lone_request_at_low_load_goes_at_once():
    rate = ArrivalRate()
    for t in (0.0, 0.5, 1.0):  # one request every 500 ms
        rate.observe(t)
    d = decide(1, 8, 1.0, 1.0, 0.01, rate, cost(5e-3, 1e-4))
    assert d.send and d.reason == "adaptive"


def test_waits_while_requests_arrive_faster_than_the_fixed_cost():
    rate = ArrivalRate()
    for i in range(50):
        rate.observe(i * 1e-4)  # 10k requests/s
    model = cost(2e-3, 1e-5)
    now = 49e-4
    assert not decide(1, 64, now, now, 0.01, rate, model).send
    # Enough rows that the added wait for all of them outweighs one batch's fixed cost.
    assert decide(30, 64, now - 1e-3, now, 0.01, rate, model).send
    # Arrivals stop: the expected gap grows and the batch goes well before the window ends.
    later = decide(1, 64, now, now, 0.01, rate, model).recheck_at
    assert now < later < now + 0.01


def test_take_size_prefers_sizes_but_sends_all_when_closing():
    assert take_size(6, 8, (1, 2, 4, 8), "adaptive") == 4
    assert take_size(6, 8, (), "adaptive") == 6
    assert take_size(20, 8, (), "full") == 8
    assert take_size(6, 8, (4, 8), "close") == 6
    assert take_size(3, 8, (4, 8), "window") == 3
    assert pow2_sizes(12) == (1, 2, 4, 8, 12) and pow2_sizes(1) == (1,)


def test_arrival_gap_is_infinite_before_any_request():
    assert math.isinf(ArrivalRate().expected_gap(0.0))


LINE = re.compile(r'^[a-z_]+\{batcher="cnn"(,[a-z]+="[^"]*")?\} (-?[0-9.e+-]+|NaN)$')


def test_stats_and_prometheus_text(onnx_model):
    engine = build(onnx_model, "cnn")
    with ek.Batcher(engine, name="cnn", max_delay_ms=5.0, warmup=True) as batcher:
        futures = [batcher.submit(x) for x in rows(12)]
        for f in futures:
            f.result(timeout=10)
        with pytest.raises(ek.EngineInputError):
            batcher.submit(rows(1).astype("float64"))
        stats = batcher.stats()
        text = batcher.prometheus()
    assert stats["completed"] == 12 and stats["invalid"] == 1 and stats["submitted"] == 13
    assert sum(n * c for n, c in stats["batch_size"].items()) == 12
    assert stats["queue_depth"] == 0 and stats["latency_ms"]["count"] == 12
    assert stats["latency_ms"]["p50"] <= stats["latency_ms"]["p99"]
    assert stats["model"]["runs"] >= 4  # warm-up runs seeded the cost model
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert all(LINE.match(line) for line in samples), [s for s in samples if not LINE.match(s)]
    assert 'enginekit_batcher_requests_total{batcher="cnn",outcome="completed"} 12' in samples
    buckets = [float(s.rsplit(" ", 1)[1]) for s in samples if "batch_size_bucket" in s]
    assert buckets == sorted(buckets) and buckets[-1] == stats["batches"]
    assert "# TYPE enginekit_batcher_latency_seconds summary" in text
    engine.close()


def test_waiting_decision_says_at_how_many_rows_to_look_again():
    model, rate = cost(2e-3, 1e-5), ArrivalRate()
    for i in range(50):
        rate.observe(i * 1e-4)  # 10k requests/s: a gap of 100 us
    now = 49e-4
    d = decide(1, 64, now, now, 0.01, rate, model)
    # Waiting stops paying once rows * (gap + per_row) reaches the fixed cost: 2e-3 / 1.1e-4.
    assert not d.send and d.need == math.ceil(2e-3 / (1e-4 + 1e-5))
    assert decide(d.need, 64, now, now, 0.01, rate, model).send
    assert decide(1, 8, now, now, 0.01, rate, model).need == 8  # capped at the batch size
    assert decide(3, 64, now, now, 0.01, None, model).need == 64  # fixed window: a full batch
