"""End to end: a small CNN trained here on a separable synthetic task, calibrated, built as an
INT8 ONNX Runtime engine, and held to the float32 model on held-out data."""

from __future__ import annotations

import types
from collections import Counter
from pathlib import Path

import calib_models
import numpy as np
import onnx
import pytest

import enginekit as ek
from enginekit.artifact import build_key
from enginekit.calibration import plan
from enginekit.calibration.writers import write_qdq
from enginekit.config import BuildConfig
from enginekit.errors import BuildError, CalibrationError, VerificationError
from enginekit.model import load_model

# Fixtures shared by the calibration tests (see calib_models).
tiny_cnn_path = calib_models.tiny_cnn_path
other_model_path = calib_models.other_model_path
calib_x = calib_models.calib_x
tiny_table = calib_models.tiny_table


CLASSES = 4
SHAPES = {"x": [(1, 3, 16, 16), (8, 3, 16, 16), (32, 3, 16, 16)]}


def _dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class is a fixed random pattern (same for every seed) plus strong noise."""
    patterns = np.random.default_rng(1234).standard_normal((CLASSES, 3, 16, 16))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = patterns[y] + rng.standard_normal((n, 3, 16, 16))
    return x.astype(np.float32), y


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> types.SimpleNamespace:
    torch = pytest.importorskip("torch", reason="the test CNN is trained with PyTorch")
    from torch import nn

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convs: one thread is faster than two shared ones
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES),
    )  # fmt: skip
    x, y = _dataset(1024, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for step in range(40):
        idx = slice((step * 64) % 1024, (step * 64) % 1024 + 64)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
        opt.step()
    model.eval()
    test_x, test_y = _dataset(512, seed=1)
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(test_x)).argmax(1).numpy() == test_y).mean()
    torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("int8") / "cnn.onnx"
    # The TorchScript exporter takes 0.4 s here, the dynamo one ~15 s (tested in tests/export).
    torch.onnx.export(
        model, (xt[:2],), str(path), dynamo=False, input_names=["x"], output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
    )  # fmt: skip
    return types.SimpleNamespace(
        path=path, calib_x=_dataset(256, seed=2)[0], test_x=test_x, accuracy=accuracy
    )


@pytest.fixture(scope="module")
def table(trained) -> ek.CalibrationTable:
    return ek.calibrate(trained.path, trained.calib_x, method="entropy")


def _fp32(path: Path, x: np.ndarray) -> np.ndarray:
    from enginekit.model import reference_session

    session = reference_session(load_model(path))
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _input(path: Path) -> str:
    return load_model(path).inputs[0].name


def test_int8_engine_agrees_with_fp32_top1(trained, table, tmp_path):
    assert trained.accuracy > 0.9  # the model has learned something: agreement is meaningful
    name = _input(trained.path)
    shapes = {name: SHAPES["x"]}
    engine = ek.build(
        trained.path, precision="int8", calibration=table, shapes=shapes,
        output=tmp_path / "m.ekit", verify_data=trained.test_x, min_top1_agreement=0.99,
    )  # fmt: skip
    ref = _fp32(trained.path, trained.test_x)
    got = ek.load(tmp_path / "m.ekit").infer({name: trained.test_x})
    logits = next(iter(got.values()))
    assert (logits.argmax(1) == ref.argmax(1)).mean() >= 0.99
    manifest = engine.manifest
    assert manifest["precision"] == "int8"
    assert manifest["calibration"]["sha256"] == table.sha256
    assert manifest["calibration"]["method"] == "entropy"
    out = next(iter(manifest["verify"]["outputs"].values()))
    assert manifest["verify"]["passed"] and out["top1_agreement"] >= 0.99
    assert manifest["verify"]["samples"] == 512 and out["max_abs"] > 0
    config = BuildConfig.from_json(manifest["config"])
    model = load_model(trained.path)
    version = manifest["backend"]["version"]
    assert manifest["build_key"] == build_key(model, config, version, table.sha256)
    assert manifest["build_key"] != build_key(model, config, version, None)


def test_int8_payload_runs_integer_kernels(trained, table, tmp_path):
    ek.build(
        trained.path, precision="int8", calibration=table,
        shapes={_input(trained.path): SHAPES["x"]}, output=f"{tmp_path / 'm'}/", verify=False,
    )  # fmt: skip
    payload = onnx.load(str(tmp_path / "m" / "payload" / "model.onnx"))
    ops = Counter(n.op_type for n in payload.graph.node)
    assert ops["QLinearConv"] == 3 and "Conv" not in ops


def test_calib_data_calibrates_on_the_fly_and_verifies_on_held_out_samples(trained):
    engine = ek.build(
        trained.path, precision="int8", calib_data=trained.calib_x, calib_method="percentile",
        shapes={_input(trained.path): SHAPES["x"]},
    )  # fmt: skip
    m = engine.manifest
    assert m["calibration"]["method"] == "percentile"
    assert m["calibration"]["samples"] == 256 - 25  # every 10th of 256 held out
    assert m["verify"]["samples"] == 25 and "held-out" in m["verify"]["data"]
    assert m["verify"]["passed"]


def test_gate_miss_raises_verification_error_with_the_report(trained, table):
    with pytest.raises(VerificationError, match="max_abs_error") as info:
        ek.build(
            trained.path, precision="int8", calibration=table, verify_data=trained.test_x[:64],
            max_abs_error=1e-9,
        )  # fmt: skip
    assert info.value.report["failures"] and not info.value.report["passed"]


def test_table_json_path_and_table_for_another_model(trained, table, tmp_path, tiny_table):
    path = table.save(tmp_path / "calib.json")
    engine = ek.build(trained.path, precision="int8", calibration=str(path), verify=False)
    assert engine.manifest["calibration"]["sha256"] == table.sha256
    with pytest.raises(CalibrationError, match="made for model"):
        ek.build(trained.path, precision="int8", calibration=tiny_table, verify=False)


def test_int8_without_calibration_or_with_both_is_refused(trained, table):
    with pytest.raises(BuildError, match="needs calibration"):
        ek.build(trained.path, precision="int8")
    with pytest.raises(BuildError, match="not both"):
        ek.build(trained.path, precision="int8", calibration=table, calib_data=trained.calib_x)
    with pytest.raises(BuildError, match="calibration: for precision='int8'"):
        ek.build(trained.path, calibration=table)
    # verify_data works at every precision; the int8 accuracy gates do not
    with pytest.raises(BuildError, match="^max_abs_error: for precision='int8'"):
        ek.build(trained.path, precision="fp16", verify_data=trained.test_x, max_abs_error=0.1)


def test_top1_gate_needs_real_data(trained, table):
    with pytest.raises(BuildError, match="needs real data"):
        ek.build(trained.path, precision="int8", calibration=table, min_top1_agreement=0.99)


def test_model_with_qdq_nodes_is_built_as_it_is(trained, table):
    qat = write_qdq(trained.path, table)  # stands for a quantization-aware-trained export
    engine = ek.build(qat, precision="int8", verify_data=trained.test_x[:64])
    assert engine.manifest["calibration"] == {"source": "model (Q/DQ nodes already present)"}
    assert engine.manifest["verify"]["passed"]
    with pytest.raises(CalibrationError, match="already carries"):
        ek.calibrate(qat, trained.calib_x)


def test_a_qat_model_is_verified_against_its_float_graph_and_says_so(trained, table):
    from enginekit.calibration.convert import strip_qdq
    from enginekit.model import load_model

    qat = write_qdq(trained.path, table)
    stripped = strip_qdq(load_model(qat).proto)
    assert stripped is not None
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in stripped.graph.node)
    engine = ek.build(qat, precision="int8", verify_data=trained.test_x[:64])
    verify = engine.manifest["verify"]
    assert verify["reference"].startswith("onnxruntime-cpu float graph derived from the Q/DQ model")
    # against the float graph the quantization error shows; against itself it would be 0
    assert verify["outputs"][next(iter(verify["outputs"]))]["max_abs"] > 0


def test_fp16_builds_on_cpu_and_bf16_is_refused_there(trained):
    engine = ek.build(trained.path, precision="fp16", shapes={_input(trained.path): SHAPES["x"]})
    assert engine.manifest["verify"]["passed"]
    ref = _fp32(trained.path, trained.test_x[:32])
    got = next(iter(engine.infer(trained.test_x[:32]).values()))
    assert got.dtype == np.float32 and np.abs(got - ref).max() < 0.05
    with pytest.raises(BuildError, match="bf16 on ONNX Runtime needs device='cuda'"):
        ek.build(trained.path, precision="bf16")


def test_precisions_a_backend_does_not_list_are_refused():
    fp32_only = types.SimpleNamespace(PRECISIONS=("fp32",))
    with pytest.raises(BuildError, match="builds precisions fp32, not int8"):
        plan.check_precision(fp32_only, BuildConfig(backend="x", precision="int8"))
    plan.check_precision(types.SimpleNamespace(), BuildConfig(precision="int8"))
    from enginekit.backends import onnxruntime

    assert onnxruntime.PRECISIONS == ("fp32", "fp16", "bf16", "int8")
