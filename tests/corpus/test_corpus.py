"""The corpus of real architectures: a fixed subset, one or two entries of every family, runs end
to end on onnxruntime (export, make_batch_dynamic for zoo files, build with verification, batches
1, 3 and 8 against the framework's own outputs); and the harness's own error paths."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import corpus  # noqa: E402
from corpus import harness  # noqa: E402

#: Small real architectures, every family; the whole corpus runs with `make corpus`.
SUBSET = (
    "tv-squeezenet1_1",
    "timm-resnet10t",
    "hf-bert",
    "keras-mobilenet_v2",
    "zoo-squeezenet1_0-op9",
    "zoo-shufflenet_v2-folded-op9",
)


def test_subset_covers_every_family():
    families = {e.family for e in corpus.select(SUBSET)}
    assert families == set(corpus.FAMILIES)


def test_corpus_has_at_least_30_real_architectures_with_unique_names():
    names = [e.name for e in corpus.entries()]
    assert len(names) >= 30 and len(set(names)) == len(names)


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBSET)
def test_corpus_entry_passes_end_to_end_on_onnxruntime(name, tmp_path):
    (entry,) = corpus.select([name])
    (result,) = corpus.run([entry], ["onnxruntime"], cache=tmp_path)
    assert result.passed, result.error
    assert result.build_s is not None and result.worst is not None and result.worst <= 1e-3


def test_unknown_entry_names_the_closest_one():
    with pytest.raises(harness.CorpusError, match="did you mean 'tv-resnet50'"):
        corpus.select(["tv-resnet5"])
    with pytest.raises(harness.CorpusError, match="did you mean 'transformers'"):
        corpus.select(["transformer"])


def _identity_entry(calls: list[int], fail: bool = False) -> harness.Entry:
    """A one-node model entry (not an architecture: it exercises the harness's plumbing)."""

    def make(folder: Path) -> harness.Made:
        calls.append(1)
        if fail:
            raise RuntimeError("exporter exploded\nsecond line")
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        )
        path = folder / "model.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
        sample = harness.Sample("b3", {"x": x}, (np.maximum(x, 0),))
        return harness.Made(path, {"x": [(1, 4), (3, 4), (8, 4)]}, (sample,))

    return harness.Entry("relu", "test", make)


def test_prepared_entry_comes_from_the_cache_the_second_time(tmp_path):
    calls: list[int] = []
    entry = _identity_entry(calls)
    first = harness.prepare(entry, tmp_path)
    second = harness.prepare(entry, tmp_path)
    assert calls == [1] and second.onnx == first.onnx
    np.testing.assert_array_equal(second.samples[0].expected[0], first.samples[0].expected[0])
    (result,) = corpus.run([entry], ["onnxruntime"], cache=tmp_path)
    assert result.passed and result.worst == 0.0


def test_failed_export_fails_every_backend_with_its_first_line(tmp_path):
    entry = _identity_entry([], fail=True)
    results = corpus.run([entry], ["onnxruntime", "other"], cache=tmp_path)
    assert [r.error for r in results] == ["export: RuntimeError: exporter exploded"] * 2
    assert list(tmp_path.iterdir()) == []  # nothing half-made left in the cache


def test_compare_catches_wrong_values_and_shapes_relative_to_scale():
    ref = np.array([[1e4, -2e4, 0.0, 3.0]], np.float32)
    sample = harness.Sample("b1", {}, (ref,))
    # float32 reordering: far below 1e-3 of the output's scale, though 0.0 and 3.0 moved.
    close = ref + np.array([[0.01, -0.02, 0.001, 0.01]], np.float32)
    assert harness.compare_sample({"y": close}, sample)[1] == ""
    wrong = ref.copy()
    wrong[0, 1] *= 1.01
    err, why = harness.compare_sample({"y": wrong}, sample)
    assert err > 1e-3 and "differs from the framework" in why
    assert "shape" in harness.compare_sample({"y": ref[:, :2]}, sample)[1]


def _script():
    return load_script(ROOT / "benchmarks" / "run_corpus.py", "bench_run_corpus")


def test_table_has_a_row_per_entry_and_a_column_per_backend():
    script = _script()
    results = [
        harness.Result("a", "zoo", "onnxruntime", True, "", 1.25, 1e-7),
        harness.Result("a", "zoo", "tvm", False, "build: BuildError: no | pipes", 0.5),
        harness.Result("b", "keras", "onnxruntime", True, "", 2.0, 0.0),
    ]
    text = script.table(results, ["onnxruntime", "tvm"])
    lines = text.splitlines()
    assert lines[0] == "| model | family | onnxruntime | tvm |"
    assert lines[2] == "| a | zoo | pass (1.2 s) | build: BuildError: no \\| pipes |"
    assert lines[3] == "| b | keras | pass (2.0 s) | - |"
    assert script.summary(results, ["onnxruntime", "tvm"]) == "onnxruntime: 2/2 pass; tvm: 0/1 pass"


def test_script_refuses_unknown_entries_and_backends(capsys):
    script = _script()
    assert script.main(["--entries", "hf-bertt"]) == 2
    assert "did you mean 'hf-bert'" in capsys.readouterr().err
    assert script.main(["--entries", "hf-bert", "--backends", "onnxruntim"]) == 2
    assert "did you mean 'onnxruntime'" in capsys.readouterr().err
