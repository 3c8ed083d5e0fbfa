"""benchmarks/backends.py: the FLOP count from the ONNX graph matches a hand count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from compare_helpers import ROOT
from script_loader import load_script


@pytest.fixture(scope="module")
def script():
    return load_script(ROOT / "benchmarks" / "backends.py", "bench_backends")


def test_resnet_style_flops_match_a_hand_count_and_scale_with_batch(script):
    model = script.resnet_style(64, classes=100)
    one = script.count_flops(model, {"x": (1, 3, 64, 64)})
    stem = 2 * (32 * 32 * 32) * (3 * 9)
    stage1 = 4 * 2 * (32 * 32 * 32) * (32 * 9)
    stage2 = 2 * 64 * 16 * 16 * (32 * 9 + 64 * 9 + 32 + 2 * 64 * 9)
    stage3 = 2 * 128 * 8 * 8 * (64 * 9 + 128 * 9 + 64 + 2 * 128 * 9)
    gemm = 2 * 128 * 100
    assert one == stem + stage1 + stage2 + stage3 + gemm
    assert script.count_flops(model, {"x": (4, 3, 64, 64)}) == 4 * one


def test_backend_options_parse_per_backend(script):
    assert script.backend_options(["tvm.trials=64", "tvm.target=llvm", "xla.jit=true"]) == {
        "tvm": {"trials": 64, "target": "llvm"},
        "xla": {"jit": True},
    }


def test_no_benchmark_script_shadows_a_package_it_imports():
    # A script runs with benchmarks/ first on sys.path: benchmarks/tvm.py once made every other
    # script's `import tvm` load it instead of Apache TVM.
    tests = (ROOT / "tests").resolve()
    for script in (ROOT / "benchmarks").glob("*.py"):
        spec = importlib.util.find_spec(script.stem)
        # Namespace packages (tests/backends under pytest) have no origin and shadow nothing;
        # the test packages (tests/batcher) are importable only under pytest, where tests/ is on
        # sys.path, and no script imports them.
        origin = None if spec is None or spec.origin is None else Path(spec.origin).resolve()
        assert origin is None or tests in origin.parents, f"{script.name} shadows {origin}"


@pytest.fixture(scope="module")
def peer():
    yield load_script(ROOT / "benchmarks" / "peer.py", "bench_peer")
    del sys.modules["bench_peer"]


@pytest.mark.slow
def test_peer_suite_times_every_engine_interleaved_with_accuracy(peer, onnx_model, capsys):
    # peer.py --quick exports ResNet-18 and a tiny BERT (minutes here); this runs the same
    # measuring code on the conformance CNN, which the suite has exported already.
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = {"x": [(1, 3, 16, 16), (4, 3, 16, 16), (4, 3, 16, 16)]}
    batches = tuple({"x": rng.standard_normal((b, 3, 16, 16)).astype(np.float32)} for b in (1, 4))
    calib = {"x": rng.standard_normal((20, 3, 16, 16)).astype(np.float32)}
    verify = {"x": rng.standard_normal((8, 3, 16, 16)).astype(np.float32)}
    w = peer.Workload("resnet18 cnn", onnx_model("cnn"), batches, shapes, calib, verify)
    rows = peer.measure(w, ["onnxruntime", "openvino", "no-such-backend"], rounds=1,
                        auto_backends=["onnxruntime"], auto_duration=0.1, gap=0.0)  # fmt: skip
    engines = {r["engine"] for r in rows}
    assert {"onnxruntime session (plain)", "openvino default", "openvino f32",
            "enginekit onnxruntime fp32", "enginekit onnxruntime int8",
            "enginekit openvino fp32", "enginekit openvino int8", peer.FIXED} <= engines  # fmt: skip
    timed = [r for r in rows if "ms" in r]
    assert {r["batch"] for r in timed} == {1, 4}
    assert {r["batch"] for r in timed if r["engine"] == peer.FIXED} == {1}  # batch 1 only
    plain = [r for r in timed if r["engine"] == "onnxruntime session (plain)"]
    assert all(r["vs_ort"] == 1.0 and r["cosine"] == pytest.approx(1.0) for r in plain)
    assert all(r["vs_ort_rounds"] == [1.0, 1.0] for r in plain)  # paired with itself
    assert all(r["vs_ort_rounds"][0] <= r["vs_ort_rounds"][1] for r in timed)
    assert all(len(r["load"]) == 2 for r in timed)  # before and after the rounds
    assert all(r["cosine"] > 0.99 and 0 <= r["top1"] <= 1 for r in timed)
    assert any("unavailable" in r.get("note", "") for r in rows if "no-such" in r["engine"])
    auto = [r for r in timed if r["engine"].startswith("enginekit auto -> onnxruntime")]
    assert len(auto) == 2 and auto[0]["gate_data"] == "verify_data"
    found = {g["goal"]: g for g in peer.goals(rows, quick=True)}
    assert len(found) == 7
    b1 = found["ResNet-50 b1: best enginekit fp32 vs plain ORT >= 1.2x"]
    assert b1["value"] > 0 and b1["met"] == (b1["value"] >= 1.2)
    assert found["encoder: best enginekit fp32 vs OpenVINO f32 >= 1.0x"]["met"] is None
    peer.print_table(rows)
    peer.print_goals(list(found.values()))
    out = capsys.readouterr().out
    assert "not measured" in out and "(target 1.3)" in out and "vs OV def" in out
    assert "rounds" in b1["note"] and "load" in b1["note"]


def test_peer_paired_ratios_show_the_spread_of_rounds(peer):
    # round by round: the plain session's time over the engine's, as in the same round
    base, engine = [1.0, 2.0, 4.0], [0.5, 2.0, 2.0]
    assert peer.paired(base, engine) == (2.0, 1.0, 2.0)
    # the ratio of medians (1.0) hides that the engine won two rounds of three by 2x
    assert peer.statistics.median(base) / peer.statistics.median(engine) == 1.0
    with pytest.raises(ValueError, match="equal, non-empty rounds: 3 vs 2"):
        peer.paired(base, engine[:2])
    assert peer._span([2.5, None, 1.25]) == "1.25-2.50"
    assert peer._span([None]) == "-" and peer._span(None) == "-"


@pytest.fixture(scope="module")
def int8_accuracy():
    return load_script(ROOT / "benchmarks" / "int8_accuracy.py", "bench_int8_accuracy")


def _state(*shapes):
    """A state_dict-like mapping: conv weight, then a BatchNorm's four tensors and counter."""
    names = ["conv.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    out = {n: np.zeros(s, np.float32) for n, s in zip(names, shapes, strict=True)}
    return {**out, "bn.num_batches_tracked": np.zeros((), np.int64)}


def test_weights_map_in_order_and_a_file_for_another_model_is_refused(int8_accuracy):
    ours = _state((8, 3, 3, 3), (8,), (8,), (8,), (8,))
    theirs = {f"_{k}": v for k, v in ours.items() if "num_batches" not in k}
    mapped = int8_accuracy.map_weights(ours, theirs, source="w.pth")
    assert list(mapped) == [k for k in ours if "num_batches" not in k]
    wrong = {**theirs, "_bn.bias": np.zeros(16, np.float32)}  # another model's width
    with pytest.raises(int8_accuracy.WeightsError, match=r"'_bn.bias' \(16,\) does not fit"):
        int8_accuracy.map_weights(ours, wrong, source="w.pth")
    order = ["_conv.weight", "_bn.bias", "_bn.weight", "_bn.running_mean", "_bn.running_var"]
    swapped = {k: theirs[k] for k in order}  # same shapes, BatchNorm's scale and shift swapped
    with pytest.raises(int8_accuracy.WeightsError, match=r"'_bn.bias' \(8,\) does not fit"):
        int8_accuracy.map_weights(ours, swapped, source="w.pth")
    with pytest.raises(int8_accuracy.WeightsError, match="expected 5 weight tensors .* found 4"):
        int8_accuracy.map_weights(ours, dict(list(theirs.items())[:4]), source="w.pth")


def test_float_part_names_the_first_convolutions_and_asks_for_bf16(int8_accuracy, onnx_model):
    import onnx

    from enginekit.errors import UsageError

    path = onnx_model("cnn")
    convs = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]
    args = int8_accuracy.float_part("bf16+f32:1", path, 0.97)
    assert args["f32_layers"] == convs[:1] and args["int8_float_precision"] == "bf16"
    assert args["accuracy_target"].fallback == "bf16"
    assert args["accuracy_target"].min_top1_agreement == 0.97
    assert "f32_layers" not in int8_accuracy.float_part("bf16", path, 0.97)
    for bad in ("fp16", "bf16+f32:x"):
        with pytest.raises(UsageError, match="expected f32, bf16 or bf16\\+f32:K"):
            int8_accuracy.float_part(bad, path, 0.97)


def test_tvm_bench_goals_include_the_dynamic_shape_speed_fraction():
    script = load_script(ROOT / "benchmarks" / "tvm_bench.py", "bench_tvm")

    def row(ms):
        return {"ms": ms, "ratio": {b: 1.0 for b in ms}}

    report = {
        "bert": {
            "onnxruntime": row({1: 1.0, 16: 10.0}),
            "tvm": row({1: 0.5, 16: 5.0}),
            "tvm dynamic only": row({1: 0.6, 16: 8.0}),
        }
    }
    goal = next(g for g in script.goals(report) if "dynamic only" in g["goal"])
    # 0.5 / 0.6 = 0.83 at batch 1, 5 / 8 = 0.625 at batch 16: the worst decides
    assert goal["worst_ratio"] == pytest.approx(0.625) and not goal["met"]
    report["bert"]["tvm dynamic only"] = row({1: 0.55, 16: 6.0})
    assert next(g for g in script.goals(report) if "dynamic only" in g["goal"])["met"]


def test_tvm_bench_roofline_says_whether_the_tuning_goal_is_below_the_floors(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    script = load_script(ROOT / "benchmarks" / "tvm_bench.py", "bench_tvm")
    # x [b, 1024] @ W [1024, 1024]: 4 MiB of weights, 2 MFLOP a sample
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((1024, 1024), np.float32), "w")],
    )  # fmt: skip
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    # 100 GFLOP/s (compute floor 0.021 ms), 10 GB/s (weights floor 0.419 ms)
    rates = {"peak_gflops": [50.0, 100.0], "bandwidth_gbs": [10.0, 5.0], "loadavg": [0.1]}

    def verdict(ort_ms: float, cache: int) -> str:
        report = {"corpus:mm": {"onnxruntime": {"ms": {1: ort_ms}}, "tvm": {"ms": {1: 0.6}}}}
        lines = script.roofline_section(report, {"corpus:mm": {"onnx": path}}, rates, [1], cache)
        floors = report["corpus:mm"]["roofline"][1]
        assert floors["weights_ms"] == pytest.approx(4 * 2**20 / 10e9 * 1e3)
        assert floors["goal_ms"] == pytest.approx(ort_ms / 1.3)
        assert any("tvm" in line and "1.43x layer-serial floor" in line for line in lines)
        # the median rates (75 GFLOP/s, 7.5 GB/s) give a second, higher floor
        assert floors["median_rates"]["weights_ms"] == pytest.approx(4 * 2**20 / 7.5e9 * 1e3)
        return floors["goal_verdict"]

    assert verdict(1.0, cache=0).startswith("at or above the layer-serial floor")
    assert verdict(0.5, cache=0).startswith("BELOW both floors")
    # weights that fit the cache: the cache-resident floor falls to the compute floor
    assert verdict(0.5, cache=64 << 20).startswith("BELOW the layer-serial floor")
