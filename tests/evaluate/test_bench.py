"""bench(): result structure, stop conditions, split and refused batch sizes, noise flags, JSON,
the PNG plot, bad settings as typed errors, and ``enginekit bench`` exit codes."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from compare_helpers import run_cli, stdout_json, tiny_mlp

import enginekit as ek
from enginekit.evaluate.bench import bench_many, plot, spread

FAST = {"duration": 0.06, "rounds": 2, "warmup": 0.0}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    mlp = tiny_mlp(d / "mlp.onnx")
    ek.build(mlp, shapes={"x": [(1, 16), (8, 16), (16, 16)]}, output=d / "mlp.ekit").close()
    ek.build(mlp, shapes={"x": [(4, 16), (4, 16), (8, 16)]}, output=d / "min4.ekit").close()
    return d


@pytest.fixture(scope="module")
def engine(artifacts):
    with ek.load(artifacts / "mlp.ekit") as e:
        yield e


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR", "first chunk is not IHDR"
    return struct.unpack(">II", data[16:24])


def test_bench_reports_percentiles_throughput_and_flags_the_split_batch(engine):
    result = ek.bench(engine, [1, 4, 20], **FAST)
    assert [r.batch for r in result.results] == [1, 4, 20]
    for r in result.results:
        lat = r.latency_ms
        assert r.error is None and r.runs >= 2
        assert lat.min <= lat.p50 <= lat.p90 <= lat.p99 <= lat.max
        assert r.throughput > 0 and len(r.round_throughputs) == 2
        assert r.shapes == {"x": (r.batch, 16)}
        assert r.peak_rss_mb is None or r.peak_rss_mb > 0
    assert [r.split for r in result.results] == [False, False, True]
    assert "largest profile batch 16" in result.result(20).note
    assert "2 split runs" in result.result(20).note
    assert result.engine["backend"] == "onnxruntime" and result.engine["precision"] == "fp32"
    assert {"enginekit", "numpy", "onnxruntime"} <= set(result.versions)
    assert result.host["cpus"] >= 1 and "cpu" in result.host


def test_a_run_count_stops_each_round_before_the_duration(engine):
    result = ek.bench(engine, [2], runs=6, duration=None, rounds=3, warmup=0.0)
    assert result.result(2).runs == 6
    both = ek.bench(engine, [2], runs=4, duration=60.0, rounds=2, warmup=0.0)
    assert both.result(2).runs == 4  # the count came first; 60 s were not spent


def test_a_run_count_is_exact_when_the_rounds_do_not_divide_it(engine):
    assert (
        ek.bench(engine, [1], runs=200, duration=None, rounds=3, warmup=0.0).result(1).runs == 200
    )
    assert ek.bench(engine, [1], runs=2, duration=None, rounds=3, warmup=0.0).result(1).runs == 2


def test_unstable_results_get_more_rounds_within_a_time_cap_and_say_so(engine):
    never = ek.bench(engine, [1], unstable_spread=0.0, **FAST)
    r = never.result(1)
    assert r.extra_rounds > 0 and "extra rounds (time cap reached)" in r.note
    assert len(r.round_throughputs) == FAST["rounds"]  # the numbers are the last rounds'
    assert never.settings["stabilize_cap_s"] == pytest.approx(FAST["duration"])
    assert "re-measured" in never.table()
    off = ek.bench(engine, [1], unstable_spread=0.0, stabilize=False, **FAST).result(1)
    assert off.extra_rounds == 0
    lax = ek.bench(engine, [1], unstable_spread=float("inf"), **FAST).result(1)
    assert lax.extra_rounds == 0 and "extra" not in lax.note


def test_throughput_is_printed_for_people():
    from enginekit.evaluate.report import rate

    assert rate(193050.4) == "193,050" and rate(1234.0) == "1,234"
    assert rate(12.53) == "12.5" and rate(None) == "-"


def test_a_batch_below_the_profile_minimum_is_padded_and_measured(artifacts):
    result = ek.bench(artifacts / "min4.ekit", [1, 4], **FAST)
    low, ok = result.results
    assert low.error is None and low.runs > 0  # padded to the profile's minimum batch 4
    assert ok.error is None and ok.runs > 0
    assert result.engine["path"].endswith("min4.ekit")


def test_spread_and_the_unstable_flag():
    assert spread([100.0]) is None
    assert spread([100.0, 100.0]) == 0.0
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)


def test_results_beyond_the_spread_threshold_are_flagged_unstable(engine):
    strict = ek.bench(engine, [1], unstable_spread=0.0, **FAST).result(1)
    assert strict.stable is False and "unstable" in strict.note
    lax = ek.bench(engine, [1], unstable_spread=float("inf"), **FAST).result(1)
    assert lax.stable is True
    single = ek.bench(engine, [1], duration=0.02, rounds=1, warmup=0.0).result(1)
    assert single.stable is None and single.spread is None  # one round cannot tell


def test_user_data_is_tiled_to_each_batch_size(engine):
    data = {"x": np.arange(48, dtype=np.float32).reshape(3, 16)}
    result = ek.bench(engine, [5], data=data, **FAST)
    assert result.result(5).shapes == {"x": (5, 16)}
    assert result.settings["data"] == "user"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"duration": 0}, "duration must be > 0"),
        ({"duration": -1.0}, "duration must be > 0"),
        ({"duration": None, "runs": 0}, "runs must be a positive integer"),
        ({"duration": None}, "needs a duration"),
        ({"rounds": 0}, "rounds must be"),
        ({"warmup": -1}, "warm-up"),
    ],
)
def test_settings_that_cannot_measure_are_usage_errors(engine, kwargs, match):
    with pytest.raises(ek.UsageError, match=match):
        ek.bench(engine, [1], **kwargs)


def test_bad_batch_sizes_are_usage_errors(engine):
    with pytest.raises(ek.UsageError, match="empty"):
        ek.bench(engine, [])
    with pytest.raises(ValueError, match="integers >= 1"):  # UsageError is a ValueError too
        ek.bench(engine, [0, 2])


def test_json_report_is_strict_json_with_the_documented_fields(engine):
    data = json.loads(json.dumps(ek.bench(engine, [1, 2], **FAST).to_json(), allow_nan=False))
    assert data["schema"] == "enginekit.bench/1"
    assert {"engine", "host", "versions", "settings", "results", "peak_rss_mb", "created"} <= set(
        data
    )
    row = data["results"][0]
    assert set(row["latency_ms"]) == {"p50", "p90", "p99", "max", "min", "mean"}
    for key in ("batch", "runs", "throughput", "round_throughputs", "spread", "stable", "split"):
        assert key in row
    assert data["settings"]["rounds"] == 2 and data["settings"]["duration_s"] == 0.06


def test_plot_writes_a_png_with_one_line_per_engine(engine, artifacts, tmp_path):
    results = bench_many([engine, artifacts / "mlp.ekit"], [1, 4], labels=["a", "b"], **FAST)
    assert [r.label for r in results] == ["a", "b"]
    path = plot(results, tmp_path / "sub" / "bench.png")
    assert png_size(path) == (1000, 400)
    assert path.stat().st_size > 10_000


def test_cli_bench_writes_json_and_plot(artifacts, tmp_path):
    report, png = tmp_path / "report.json", tmp_path / "report.png"
    proc = run_cli("bench", artifacts / "mlp.ekit", "--batch-sizes", "1,4,32", "--duration",
                   "0.05", "--rounds", "2", "--warmup", "0", "--json-file", report, "--plot", png)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "SAMPLES/S" in proc.stdout and "(split)" in proc.stdout
    data = json.loads(report.read_text())
    assert data["schema"] == "enginekit.bench/1"
    assert [r["batch"] for r in data["engines"][0]["results"]] == [1, 4, 32]
    assert png_size(png) == (1000, 400)

    to_stdout = run_cli("bench", "--json", artifacts / "mlp.ekit", "--batch-sizes", "2",
                        "--runs", "3", "--warmup", "0")  # fmt: skip
    assert to_stdout.returncode == 0, to_stdout.stderr
    assert stdout_json(to_stdout)["engines"][0]["results"][0]["runs"] == 3


@pytest.mark.parametrize(
    "flags",
    [["--duration", "0"], ["--runs", "0"], ["--batch-sizes", "1,x"], ["--rounds", "0"]],
    ids=["zero-duration", "zero-runs", "bad-sizes", "zero-rounds"],
)
def test_cli_bench_usage_errors_exit_2(artifacts, flags):
    proc = run_cli("bench", artifacts / "mlp.ekit", *flags)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("enginekit bench:")


def test_a_round_after_another_engines_waits_for_its_idle_threads(engine, artifacts, monkeypatch):
    from enginekit.evaluate import bench as mod

    log: list = []
    run = mod._round
    monkeypatch.setattr(mod, "_settle", lambda: log.append("settle"))
    monkeypatch.setattr(
        mod, "_round", lambda e, job, *a: log.append((e, job.batch)) or run(e, job, *a)
    )
    with ek.load(artifacts / "mlp.ekit") as other:
        bench_many([engine, other], [1, 4], stabilize=False, **FAST)
        a, b = (engine, 1), (engine, 4)
        c, d = (other, 1), (other, 4)
        assert log == [a, b, "settle", c, d, "settle", a, b, "settle", c, d]
        log.clear()
        ek.bench(other, [1, 4], **FAST)  # one engine: its rounds follow each other at once
    assert "settle" not in log and len(log) >= 4
