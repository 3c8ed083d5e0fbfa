"""Several engine calls in flight (``streams``): the same rows in the same order as one stream;
``"auto"`` measures and records its choice; a resume runs the engine as the first run did."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dataset_helpers import cnn_rows, naive, read_output

import enginekit as ek

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
from enginekit.dataset import ledger as ledger_mod
from enginekit.dataset.streams import choose_streams
from enginekit.errors import UsageError


def test_streams_keep_the_source_order_row_for_row(ekit, tmp_path):
    x = cnn_rows(45)  # not a multiple of the batch or the shard
    np.save(tmp_path / "x.npy", x)
    with ek.load(ekit("cnn"), threads=1) as engine:
        s = ek.infer_dataset(
            engine, tmp_path / "x.npy", tmp_path / "out", 4, shard_rows=12, streams=3
        )
        ref = naive(engine, {"x": x}, 4)
    assert (s.streams, s.rows, s.shards) == (3, 45, 4)
    got = read_output(tmp_path / "out")
    assert got["row"].tolist() == list(range(45))
    np.testing.assert_array_equal(got["output"], ref["output"])


def test_auto_from_an_artifact_measures_both_and_records_the_choice(ekit, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(24))
    s = ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", tmp_path / "out", 4, progress=False)
    choice = s.stream_choice
    assert choice is not None and s.streams == choice.streams
    assert (choice.trials[0].streams, choice.trials[0].threads) == (1, None)
    if choice.trials[1:]:  # a host with one core measures nothing
        assert choice.trials[1].threads == 1 and choice.trials[1].rows_per_s > 0
    assert s.to_json()["stream_choice"]["streams"] == s.streams
    ledger = json.loads((tmp_path / "out" / ledger_mod.NAME).read_text())
    assert ledger["engine"] == {"streams": s.streams, "threads": s.threads}


def test_auto_on_a_given_engine_keeps_one_stream_without_measuring(ekit, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(8))
    with ek.load(ekit("cnn")) as engine:
        s = ek.infer_dataset(engine, tmp_path / "x.npy", tmp_path / "out", 4)
    assert s.streams == 1 and s.stream_choice is not None and s.stream_choice.trials == ()


def test_choice_prefers_more_streams_within_tolerance(ekit, monkeypatch):
    from enginekit.dataset import streams as mod

    rates = {1: 100.0, 2: 92.0}  # two streams 8% slower: within 10%, chosen
    cpu = {1: 0.01, 2: 0.01 / 0.92}  # CPU-s per row: every core busy in both
    monkeypatch.setattr(mod, "rate_and_cpu", lambda e, s, b, n, sec: (rates[n], cpu[n]))
    monkeypatch.setattr(mod, "SETTLE_S", 0.0)  # nothing spins: the measurements are fakes
    with ek.load(ekit("cnn")) as engine:
        other = ek.load(ekit("cnn"), threads=1)
        choice, chosen = choose_streams(engine, {"x": cnn_rows(4)}, 4, lambda t: other, available=2)
        assert (choice.streams, choice.threads, chosen) == (2, 1, other)
        rates[2], cpu[2] = 80.0, 0.01 / 0.8  # 20% slower and 25% more CPU per row: one stream
        choice, chosen = choose_streams(engine, {"x": cnn_rows(4)}, 4, lambda t: other, available=2)
        assert (choice.streams, chosen) == (1, None)
        # 20% slower but no more CPU per row: one stream's threads took more of a busy host's
        # cores (spinning), not less work per row; two streams.
        cpu[2] = 0.01
        choice, chosen = choose_streams(engine, {"x": cnn_rows(4)}, 4, lambda t: other, available=2)
        assert (choice.streams, chosen) == (2, other)
        assert choice.trials[1].rows_per_cpu_s == (100.0,) * 5


def test_choice_compares_rounds_pairwise_not_one_quiet_moment(ekit, monkeypatch):
    # One round where one stream ran alone on a quiet host (140) must not outvote four where
    # two streams kept pace: each configuration's best alone chose one stream here.
    from enginekit.dataset import streams as mod

    runs = {1: iter([100.0, 100.0, 140.0, 100.0, 100.0]), 2: iter([100, 95, 100, 95, 100.0])}
    monkeypatch.setattr(mod, "rate_and_cpu", lambda e, s, b, n, sec: (r := next(runs[n]), 1 / r))
    monkeypatch.setattr(mod, "SETTLE_S", 0.0)
    with ek.load(ekit("cnn")) as engine:
        other = ek.load(ekit("cnn"), threads=1)
        choice, chosen = choose_streams(engine, {"x": cnn_rows(4)}, 4, lambda t: other, available=2)
        other.close()
    assert (choice.streams, chosen) == (2, other)
    assert choice.trials[0].measured == (100.0, 100.0, 140.0, 100.0, 100.0)
    assert choice.trials[0].rows_per_s == 140.0


def test_streams_are_measured_after_the_engines_idle_threads_settle(ekit, monkeypatch):
    # ONNX Runtime's idle threads spin ~50 ms after the engine's last call: measured at once,
    # one-thread streams shared a core with them for half of their 0.1 s and looked slower
    # than one stream (0.78x under load) when they ran 1.7x faster.
    from enginekit.dataset import streams as mod

    events = []
    monkeypatch.setattr(mod, "settle", lambda: events.append("settle") or 0.0)
    monkeypatch.setattr(mod, "rate_and_cpu", lambda e, s, b, n, sec: events.append(n) or (1.0, 1.0))
    with ek.load(ekit("cnn")) as engine:
        other = ek.load(ekit("cnn"), threads=1)
        choose_streams(engine, {"x": cnn_rows(4)}, 4, lambda t: other, available=2, rounds=2)
        other.close()
    assert events == [1, "settle", 2] * 2


def test_settle_waits_while_a_thread_spins_and_one_window_without(monkeypatch):
    # A fake clock: each window, the process used a whole core while a runtime's idle thread
    # spun (``spinning`` windows), then none.
    from enginekit.dataset import streams as mod

    class Clock:
        def __init__(self, spinning: int) -> None:
            self.wall = self.cpu = 0.0
            self.spinning = spinning

        def perf_counter(self) -> float:
            return self.wall

        def process_time(self) -> float:
            return self.cpu

        def sleep(self, s: float) -> None:
            self.wall += s
            self.cpu += s if self.spinning > 0 else 0.0
            self.spinning -= 1

    for spinning, waited in [(5, 6), (0, 1), (100, 10)]:  # 10 windows: the 0.1 s limit
        monkeypatch.setattr(mod, "time", Clock(spinning))
        assert round(mod.settle() / mod.SETTLE_WINDOW_S) == waited


def test_resume_reuses_the_streams_and_threads_of_the_first_run(ekit, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(16))
    out = tmp_path / "out"
    ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", out, 4, shard_rows=4, streams=2, threads=1)
    ledger = ledger_mod.Ledger.read(out)
    assert ledger is not None and ledger.engine == {"streams": 2, "threads": 1}
    ledger.shards, ledger.complete = ledger.shards[:1], False  # as if killed after one shard
    ledger.save()
    s = ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", out, resume=True)
    assert (s.streams, s.threads, s.shards_skipped, s.rows) == (2, 1, 1, 16)
    assert s.stream_choice is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"streams": 0}, "streams must be 'auto' or an integer"),
        ({"streams": "many"}, "streams must be 'auto' or an integer"),
    ],
)
def test_bad_streams_are_refused(ekit, tmp_path, kwargs, message):
    np.save(tmp_path / "x.npy", cnn_rows(4))
    with pytest.raises(UsageError, match=message):
        ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", tmp_path / "out", **kwargs)


def test_threads_with_a_loaded_engine_is_refused(ekit, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(4))
    with ek.load(ekit("cnn")) as engine:
        with pytest.raises(UsageError, match="threads is set when infer_dataset loads"):
            ek.infer_dataset(engine, tmp_path / "x.npy", tmp_path / "out", threads=1)
