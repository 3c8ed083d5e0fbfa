"""benchmarks/dataset_cores.py: the accounting of a job's core-seconds adds up."""

from __future__ import annotations

import sys

import pytest
from compare_helpers import ROOT
from script_loader import load_script

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def script():
    yield load_script(ROOT / "benchmarks" / "dataset_cores.py", "bench_dataset_cores")
    # The script put benchmarks/ on sys.path and imported benchmarks/dataset.py.
    sys.modules.pop("bench_dataset_cores", None)
    sys.modules.pop("dataset", None)
    while str(ROOT / "benchmarks") in sys.path:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_core_seconds_of_b_and_c_add_up(script, tmp_path):
    artifact = script.bench.demo_cnn(tmp_path)
    x = script.bench.make_parquet(tmp_path / "x", 512, files=1)
    script.bench.make_parquet(tmp_path / "src", 1024, files=2)
    got = script.rounds(artifact, tmp_path / "src", x, tmp_path, 64, 2, 2, 1024)
    for run in got["b"] + got["c"]:
        # Every core-second is in exactly one part: this process's CPU (engine, streams,
        # reader, writer, main) or not ours.
        ours = sum(run.get(k, 0.0) for k in ("engine", "streams", "reader", "writer", "main"))
        assert ours == pytest.approx(run["cpu"], abs=1e-6) or ours > run["cpu"]
        assert run["not_ours"] == pytest.approx(max(run["cores_s"] - run["cpu"], 0.0))
        assert run["engine"] > 0 and run["calls"] == 1024 // 64
        assert run["head"] >= 0 and run["tail"] >= 0
    assert all(r["reader"] > 0 and r["writer"] > 0 for r in got["b"])
    assert "median" in script.table(got)
