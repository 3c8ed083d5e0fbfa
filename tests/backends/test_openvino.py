"""The OpenVINO backend: payload and its fallback, precisions and the host ISA, options, threads,
the asynchronous queue, and bad input."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit import target
from enginekit.errors import ArtifactError, BuildError

pytest.importorskip("openvino")
ov_backend = pytest.importorskip("enginekit.backends.openvino")

SHAPES = CASES["cnn"].shapes


def _has(flags: tuple[str, ...]) -> bool:
    return bool(set(flags) & target.cpu_flags())


@pytest.fixture(scope="module")
def cnn_artifact(onnx_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("ov") / "cnn.ekit"
    ek.build(onnx_model("cnn"), backend="openvino", shapes=SHAPES, output=path)
    return path


def _fake_host(monkeypatch, flags: set[str]) -> None:
    """This host as if its CPU had ``flags`` (enginekit.target is where every ISA check reads)."""
    target.cpu_flags.cache_clear()
    monkeypatch.setattr(target, "cpu_flags", lambda: frozenset(flags))


def test_available_reports_version_and_cpu():
    avail = ek.backends.availability("openvino")
    assert avail.available and avail.devices == ("cpu",)
    assert avail.version and avail.version.startswith("20")


def test_artifact_holds_compiled_blob_and_ir_and_loads_the_blob(cnn_artifact, onnx_model):
    engine = ek.load(cnn_artifact)
    m = engine.manifest
    assert set(m["payload"]) == {"compiled.blob", "model.xml", "model.bin"}
    meta = m["backend"]["metadata"]
    assert meta["inference_precision"] == "f32"
    assert meta["openvino_version"] == ov_backend.version()
    assert meta["blob"]["cpu_flags"] == sorted(target.cpu_flags())
    assert engine.compiled_from == "blob"
    feeds = CASES["cnn"].feeds(3)
    np.testing.assert_allclose(
        engine.infer(feeds)["output"], reference(onnx_model("cnn"), feeds)["output"], 1e-3, 1e-4
    )


def test_blob_for_other_cpu_flags_falls_back_to_the_ir(cnn_artifact, onnx_model, monkeypatch):
    # Toggled, so the host differs from the build's whether or not this CPU has VNNI.
    _fake_host(monkeypatch, set(target.cpu_flags()) ^ {"avx512_vnni"})
    engine = ek.load(cnn_artifact)
    assert engine.compiled_from == "ir"
    assert (
        "other ISA flags"
        in ek.backends.get("openvino").inspect(ek.artifact.open_artifact(cnn_artifact))[
            "blob_problem"
        ]
    )
    feeds = CASES["cnn"].feeds(2)
    np.testing.assert_allclose(
        engine.infer(feeds)["output"], reference(onnx_model("cnn"), feeds)["output"], 1e-3, 1e-4
    )


def test_blob_from_another_openvino_version_falls_back_to_the_ir(onnx_model, tmp_path):
    out = tmp_path / "cnn"
    ek.build(onnx_model("cnn"), backend="openvino", shapes=SHAPES, output=f"{out}/")
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["backend"]["metadata"]["openvino_version"] = "2020.1.0-0000"
    manifest_path.write_text(json.dumps(manifest))
    engine = ek.load(out)
    assert engine.compiled_from == "ir"
    assert engine.infer(CASES["cnn"].feeds(1))["output"].shape == (1, 10)


def test_ir_only_export_compiles_on_load(onnx_model, tmp_path):
    path = tmp_path / "ir.ekit"
    ek.build(onnx_model("mlp"), backend="openvino", output=path, export="ir")
    engine = ek.load(path)
    assert "compiled.blob" not in engine.manifest["payload"]
    assert engine.compiled_from == "ir"


def test_corrupt_payload_is_an_artifact_error(cnn_artifact, tmp_path):
    out = tmp_path / "cnn"
    ek.build(ek.load(cnn_artifact).manifest["source"]["path"], backend="openvino", shapes=SHAPES,
             output=f"{out}/")  # fmt: skip
    blob = out / "payload" / "compiled.blob"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="compiled.blob.*checksum"):
        ek.load(out)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"performance_hint": "latncy"}, "did you mean 'latency'"),
        ({"performance_hint": "fast"}, "expected one of latency, throughput"),
        ({"streams": 0}, "streams=0: expected an integer >= 1 or 'auto'"),
        ({"threads": "many"}, "threads='many'"),
        ({"export": "blob"}, "expected one of compiled, ir"),
        ({"stream": 2}, "no option.*'stream'.*streams"),
        ({"int8_float_precision": "fp16"}, "expected one of f32, bf16"),
        ({"int8_float_precision": "bf16"}, "applies to int8 builds; this build is fp32"),
    ],
)
def test_bad_options_raise_build_error(mlp_path, options, message):
    with pytest.raises(BuildError, match=message):
        ek.build(mlp_path, backend="openvino", **options)


def test_throughput_hint_and_streams_are_applied(mlp_path):
    engine = ek.build(mlp_path, backend="openvino", performance_hint="throughput", streams=2,
                      threads=2)  # fmt: skip
    meta = engine.manifest["backend"]["metadata"]
    assert (meta["performance_hint"], meta["streams"], meta["threads"]) == ("throughput", 2, 2)


def test_bf16_is_refused_on_a_host_without_bf16(mlp_path, monkeypatch):
    _fake_host(monkeypatch, {"avx2", "fma", "avx512f"})
    with pytest.raises(BuildError, match="bf16 on OpenVINO's CPU plugin needs one of the ISA"):
        ek.build(mlp_path, backend="openvino", precision="bf16")


def test_bf16_artifact_is_refused_on_load_by_a_host_without_bf16(mlp_path, tmp_path, monkeypatch):
    if not _has(ov_backend._ISA["bf16"]):
        pytest.skip(f"this CPU has no bf16 ISA ({sorted(target.cpu_flags())})")
    path = tmp_path / "bf16.ekit"
    engine = ek.build(mlp_path, backend="openvino", precision="bf16", output=path)
    assert engine.manifest["backend"]["metadata"]["inference_precision"] == "bf16"
    assert engine.manifest["verify"]["passed"]
    _fake_host(monkeypatch, {"avx2", "fma"})
    with pytest.raises(ArtifactError, match="bf16.*needs one of the ISA flags"):
        ek.load(path)


def test_fp16_is_refused_where_the_cpu_would_compute_in_another_precision(mlp_path):
    if _has(ov_backend._ISA["fp16"]):
        pytest.skip("this CPU computes fp16 natively")
    with pytest.raises(BuildError, match="fp16 on OpenVINO's CPU plugin needs"):
        ek.build(mlp_path, backend="openvino", precision="fp16")


def test_int8_from_calibration_data_runs_int8_kernels(onnx_model):
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((64, 3, 16, 16)).astype(np.float32)
    engine = ek.build(onnx_model("cnn"), backend="openvino", precision="int8", shapes=SHAPES,
                      calib_data=calib, max_abs_error=1.0)  # fmt: skip
    assert engine.manifest["verify"]["passed"]
    assert engine.manifest["calibration"]["qdq"]["style"] == "onnxruntime-cpu"
    runtime = engine.compiled.get_runtime_model()
    precisions = {op.get_rt_info()["runtimePrecision"].astype(str) for op in runtime.get_ops()}
    assert precisions & {"u8", "i8"}, precisions


def test_int8_weights_keep_8_bits_with_vnni_and_7_without(monkeypatch):
    """u8*s8 kernels without VNNI/AMX saturate their int16 pair sums: 7-bit weights there;
    a VNNI host (this round's Zen 4) takes the 8-bit path."""
    from enginekit.backends import onnxruntime as ort_backend
    from enginekit.config import BuildConfig

    config = BuildConfig(backend="openvino")
    target.cpu_flags.cache_clear()
    for flags, reduced in (({"avx2", "fma"}, True), ({"avx2", "avx512f", "avx512_vnni"}, False)):
        monkeypatch.setattr(target, "cpu_flags", lambda flags=frozenset(flags): flags)
        assert ov_backend.qdq_options(config)["reduce_range"] is reduced, flags
        ort = ort_backend.qdq_options(BuildConfig(backend="onnxruntime"))
        assert ort["reduce_range"] is reduced, flags


def test_int8_float_part_in_bf16_is_refused_on_a_host_without_bf16(onnx_model, monkeypatch):
    _fake_host(monkeypatch, {"avx2", "fma", "avx512f", "avx512_vnni"})
    calib = np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32)
    with pytest.raises(BuildError, match="int8 with int8_float_precision=bf16 on OpenVINO's CPU"):
        ek.build(onnx_model("cnn"), backend="openvino", precision="int8", shapes=SHAPES,
                 calib_data=calib, int8_float_precision="bf16")  # fmt: skip


def test_int8_float_part_runs_bf16_kernels_with_the_option(onnx_model, tmp_path, monkeypatch):
    """Accuracy-aware int8 with fallback bf16: the Q/DQ layers run int8 kernels, the layers
    kept float run bf16 ones (OpenVINO's bf16 hint on a Q/DQ model), the search measured its
    plans that way, and a host without bf16 refuses the artifact."""
    if not _has(ov_backend._ISA["bf16"]):
        pytest.skip(f"this CPU has no avx512_bf16/amx_bf16 ({sorted(target.cpu_flags())})")
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((64, 3, 16, 16)).astype(np.float32)
    path = tmp_path / "int8bf16.ekit"
    engine = ek.build(onnx_model("cnn"), backend="openvino", precision="int8", shapes=SHAPES,
                      calib_data=calib, int8_float_precision="bf16", output=path,
                      accuracy_target=ek.AccuracyTarget(max_abs_error=1.0, fallback="bf16"))  # fmt: skip
    assert engine.manifest["backend"]["metadata"]["inference_precision"] == "bf16"
    found = engine.manifest["calibration"]["accuracy_search"]
    assert found["fallback_precision"] == "bf16", found
    runtime = engine.compiled.get_runtime_model()
    precisions = {op.get_rt_info()["runtimePrecision"].astype(str) for op in runtime.get_ops()}
    assert precisions & {"u8", "i8"} and "bf16" in precisions, precisions
    _fake_host(monkeypatch, {"avx2", "fma", "avx512_vnni"})
    with pytest.raises(ArtifactError, match="int8_float_precision=bf16.*needs one of the ISA"):
        ek.load(path)


def test_concurrent_infer_from_threads_matches_serial(cnn_artifact):
    engine = ek.load(cnn_artifact)
    batches = [CASES["cnn"].feeds(1 + i % 8, seed=i) for i in range(16)]
    want = [engine.infer(b)["output"] for b in batches]
    got: list[np.ndarray | None] = [None] * len(batches)

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = engine.infer(batches[i])["output"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_infer_async_runs_on_openvinos_queue_and_matches_infer(cnn_artifact):
    engine = ek.load(cnn_artifact)
    batches = [CASES["cnn"].feeds(1 + i % 8, seed=i) for i in range(12)]
    futures = [engine.infer_async(b) for b in batches]
    assert engine._queue is not None  # OpenVINO's AsyncInferQueue, not the base class's threads
    for b, f in zip(batches, futures):
        np.testing.assert_array_equal(f.result(timeout=60)["output"], engine.infer(b)["output"])
    # A batch past the profile is split by the base class, still through a Future.
    big = CASES["cnn"].feeds(11)
    np.testing.assert_array_equal(
        engine.infer_async(big).result(timeout=60)["output"], engine.infer(big)["output"]
    )
    with pytest.raises(ek.EngineInputError, match="dtype"):
        engine.infer_async(big["x"].astype(np.float64))
    engine.close()


def test_load_sets_threads_and_refuses_spinning_naming_its_load_options(cnn_artifact):
    with ek.load(cnn_artifact, threads=1) as engine:
        assert engine.compiled_from == "blob"
        assert int(engine.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    with pytest.raises(
        ek.UsageError, match=r"cannot set 'spinning' at load \(its load options: threads\)"
    ):
        ek.load(cnn_artifact, spinning=False)
