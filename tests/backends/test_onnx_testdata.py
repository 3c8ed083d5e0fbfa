"""ONNX's own backend test data: enginekit's onnxruntime backend passes every case raw ONNX Runtime
passes, through ``ek.build`` (default settings, verification on) and ``ek.load``.

Runs benchmarks/onnx_testdata.py's ``run`` on the model folders (pytorch-converted,
pytorch-operator, simple) in full and on ``node`` (made from onnx's case definitions where the
wheel ships no data folder, as 1.23.2) within a time budget; ``python benchmarks/onnx_testdata.py``
runs all of node (1506 cases).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    return load_script(ROOT / "benchmarks" / "onnx_testdata.py", "benchmarks_onnx_testdata")


def test_enginekit_onnxruntime_passes_every_case_raw_onnxruntime_passes(capsys):
    runner = _runner()
    report = runner.run(["onnxruntime"], ["pytorch-converted", "pytorch-operator", "simple"])
    node = runner.run(["onnxruntime"], ["node"], budget=45.0)
    raw = report["raw_onnxruntime"]["passed"] + node["raw_onnxruntime"]["passed"]
    ours = report["backends"]["onnxruntime"]["passed"] + node["backends"]["onnxruntime"]["passed"]
    with capsys.disabled():
        print(
            f"\nONNX backend test data (onnx {report['onnx']}): raw ONNX Runtime passes {raw} of "
            f"{report['cases'] + node['cases']} cases; enginekit onnxruntime passes {ours} of them"
            + (f" (node: {node['cases']} of {node['of']} cases run)" if not node["absent"] else
               " (node: not in this onnx wheel)")
        )  # fmt: skip
    assert report["cases"] >= 100 and raw >= 90
    failed = {
        **report["backends"]["onnxruntime"]["failed_where_raw_passes"],
        **node["backends"]["onnxruntime"]["failed_where_raw_passes"],
    }
    assert failed == {}, failed
    assert ours == raw


@pytest.mark.parametrize("case", ["test_sequence_model8"])
def test_a_case_whose_inputs_cannot_be_generated_builds_with_its_own_data(case):
    runner = _runner()
    loaded = runner.load_case(runner.data_root() / "simple" / case, "simple")
    if loaded is None:
        pytest.skip(f"{case} is not in this onnx wheel")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        err, how = runner.run_enginekit(loaded, "onnxruntime", Path(tmp))
    assert err is None and how == "verify_data (asked for)"


def test_reasons_group_failures_by_error_with_names_and_numbers_replaced():
    runner = _runner()
    failed = {
        "node/a": "BuildError: node n1 (Foo): op Foo is not supported",
        "node/b": "BuildError: node n7 (Foo): op Foo is not supported",
        "node/c": "output 0: max abs error 0.25",
    }
    groups = runner.reasons(failed)
    assert groups[0] == (
        "BuildError: node … (Foo): op Foo is not supported",
        ["node/a", "node/b"],
    )
    assert groups[1][1] == ["node/c"]


def test_only_and_sample_select_cases():
    runner = _runner()
    made = [runner.Case(f"test_{n}", "node", Path("m.onnx"), []) for n in ("abs", "add", "and")]
    assert [c.name for c in runner.select(made, only=r"node/test_a[bn]")] == [
        "test_abs",
        "test_and",
    ]
    assert [c.name for c in runner.select(made, sample=2)] == ["test_abs", "test_and"]


def test_goals_compare_each_backend_with_enginekit_onnxruntime():
    runner = _runner()
    report = {"backends": {"onnxruntime": {"passed": 100}, "xla": {"passed": 95}}}
    (goal,) = runner.goals(report)
    assert goal["backend"] == "xla" and goal["met"] and goal["ratio"] == 0.95
    assert runner.goals({"backends": {"xla": {"passed": 3}}}) == []
