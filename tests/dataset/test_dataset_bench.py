"""benchmarks/dataset.py: the CPU budget bound and the spare-core rounds."""

from __future__ import annotations

import sys

import pytest
from compare_helpers import ROOT
from script_loader import load_script

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield load_script(ROOT / "benchmarks" / "dataset.py", "bench_dataset_budget")
    finally:
        sys.modules.pop("bench_dataset_budget", None)
        while str(ROOT / "benchmarks") in sys.path:
            sys.path.remove(str(ROOT / "benchmarks"))


def test_cpu_budget_is_the_core_seconds_arithmetic(bench):
    # (c): 80k rows/s on 2 cores = 0.025 core-s per 1k rows, its engine using 0.024 of it.
    got = bench.cpu_budget(80_000, 0.024, 0.002, 0.001, 2)
    assert got["busy"] == pytest.approx(1.92)
    assert got["bound"] == pytest.approx(0.025 / 0.027)
    # Reading and writing that fit in the idle core-seconds cost (b) nothing.
    assert bench.cpu_budget(40_000, 0.025, 0.010, 0.005, 2)["bound"] == 1.0
    assert bench.cpu_budget(40_000, 0.025, 0.010, 0.005, 2)["busy"] == pytest.approx(1.0)


def test_spare_core_rounds_compare_b_and_c_on_one_stream(bench, tmp_path):
    from enginekit.dataset.streams import cores

    artifact = bench.demo_cnn(tmp_path)
    x = bench.make_parquet(tmp_path / "x", 512, files=1)
    bench.make_parquet(tmp_path / "src", 1024, files=2)
    got = bench.spare_core_rounds(artifact, tmp_path / "src", tmp_path, x, 64, 2, 1024)
    if cores() < 2:
        assert got is None
        return
    assert got["threads"] == cores() - 1
    assert len(got["b"]) == len(got["c"]) == len(got["ratios"]) == 2
    assert all(v > 0 for v in got["b"] + got["c"])
    assert got["ratio"] == pytest.approx(
        sorted(got["ratios"])[0] / 2 + sorted(got["ratios"])[1] / 2
    )
    assert not list(tmp_path.glob("spare-*"))  # each round's output removed
