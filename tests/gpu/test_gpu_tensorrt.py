"""TensorRT on a real GPU: profiles, precisions, timing cache, artifacts, CUDA arrays.

Skipped (with the backend's reason) wherever TensorRT or a CUDA device is missing. Run them all
with ``tests/gpu/run.sh`` on a GPU machine. Models are tiny so that each build takes seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import enginekit as ek
from enginekit import backends
from enginekit.config import DEFAULT_TOLERANCE, Precision

sys.path.insert(0, str(Path(__file__).parent.parent / "backends" / "trt"))
import trt_models

AVAIL = backends.availability("tensorrt")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not AVAIL.available, reason=f"tensorrt unavailable: {AVAIL.reason}"),
]
TWO_PROFILES = [{"x": [(1, 16), (8, 16), (32, 16)]}, {"x": [(33, 16), (64, 16), (128, 16)]}]


def reference(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(
        proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def assert_matches(engine: ek.Engine, proto: onnx.ModelProto, feeds, precision: Precision) -> None:
    atol, rtol = DEFAULT_TOLERANCE[precision]
    got = engine.infer(feeds)
    for (name, g), w in zip(got.items(), reference(proto, feeds)):
        np.testing.assert_allclose(g, w, atol=atol, rtol=rtol, err_msg=name)


def x(rows: int, seed: int = 0, width: int = 16) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)}


@pytest.fixture(scope="module")
def mlp_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "mlp.ekit"
    engine = ek.build(
        trt_models.mlp(), backend="tensorrt", shapes=TWO_PROFILES, device="cuda",
        output=out, workspace="256MiB", builder_optimization_level=2,
    )  # fmt: skip
    yield engine, out
    engine.close()


def test_two_profiles_pick_by_shape_and_match_the_reference(mlp_engine):
    engine, _ = mlp_engine
    for rows in (1, 7, 32, 33, 128, 200):  # 200 is split into 128 + 72
        assert_matches(engine, trt_models.mlp(), x(rows, seed=rows), Precision.FP32)
    assert all(slot is not None for slot in engine._slots), "both profiles' contexts were used"


def test_manifest_records_what_loading_needs(mlp_engine):
    engine, _ = mlp_engine
    m = engine.manifest
    assert m["target"]["kind"] == "cuda" and m["target"]["tensorrt"] == AVAIL.version
    assert m["target"]["compute_capability"] and m["target"]["gpu"]
    assert len(m["profiles"]) == 2 and set(m["payload"]) == {"model.plan", "timing.cache"}
    assert len(m["backend"]["metadata"]["build_key"]) == 64


def test_artifact_loads_and_runs_like_the_built_engine(mlp_engine):
    engine, path = mlp_engine
    feeds = x(40, seed=3)
    with ek.load(path) as loaded:
        np.testing.assert_array_equal(loaded.infer(feeds)["y"], engine.infer(feeds)["y"])


def test_load_on_another_gpu_or_version_is_refused_before_deserializing(tmp_path):
    out = tmp_path / "mlp/"
    ek.build(trt_models.mlp(), backend="tensorrt", shapes=TWO_PROFILES, device="cuda", output=out)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    real_cc = manifest["target"]["compute_capability"]
    manifest["target"]["compute_capability"] = "1.0"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ek.ArtifactError, match="compute capability 1.0.*enginekit build"):
        ek.load(out)
    manifest["target"]["compute_capability"] = real_cc
    manifest["target"]["tensorrt"] = "10.0.0.1"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ek.ArtifactError, match="built with TensorRT 10.0.0.1"):
        ek.load(out)


def test_fp16_builds_within_fp16_tolerance(tmp_path):
    proto = trt_models.convnet()
    shapes = {"x": [(1, 3, 8, 8), (4, 3, 8, 8), (16, 3, 8, 8)]}
    engine = ek.build(proto, backend="tensorrt", shapes=shapes, precision="fp16", device="cuda")
    feeds = {"x": np.random.default_rng(1).standard_normal((5, 3, 8, 8)).astype(np.float32)}
    assert_matches(engine, proto, feeds, Precision.FP16)
    rewrite = engine.manifest["backend"]["metadata"]["plan"]["precision"]["rewrite"]
    assert rewrite == ("none" if AVAIL.version.startswith("10.") else "fp16")


@pytest.mark.skipif(not (AVAIL.version or "").startswith("10."), reason="TensorRT 10 only")
def test_tensorrt_10_strongly_typed_fp16_uses_the_rewrite():
    proto = trt_models.mlp()
    engine = ek.build(
        proto, backend="tensorrt", shapes=TWO_PROFILES[0], precision="fp16", device="cuda",
        strongly_typed=True,
    )  # fmt: skip
    assert engine.manifest["backend"]["metadata"]["plan"]["precision"]["rewrite"] == "fp16"
    assert_matches(engine, proto, x(9), Precision.FP16)


def test_int8_from_a_qdq_model_builds_within_int8_tolerance(tmp_path):
    from test_trt_precision import quantize

    qdq = quantize(trt_models.mlp(), tmp_path)
    onnx.save(qdq, tmp_path / "qdq.onnx")
    engine = ek.build(
        trt_models.mlp(), backend="tensorrt", shapes=TWO_PROFILES[0], precision="int8",
        device="cuda", qdq_model=str(tmp_path / "qdq.onnx"),
    )  # fmt: skip
    assert engine.manifest["backend"]["metadata"]["calibration_sha256"]
    assert_matches(engine, trt_models.mlp(), x(12, seed=5), Precision.INT8)


def test_timing_cache_is_saved_per_gpu_and_version_and_loaded_next_time(tmp_path):
    cache_dir = tmp_path / "caches"
    cache_dir.mkdir()
    first = ek.build(
        trt_models.mlp(), backend="tensorrt", shapes=TWO_PROFILES[0], device="cuda",
        timing_cache=str(cache_dir),
    )  # fmt: skip
    info = first.manifest["backend"]["metadata"]["timing_cache"]
    assert not info["loaded"] and Path(info["path"]).parent == cache_dir
    assert Path(info["path"]).is_file() and AVAIL.version in Path(info["path"]).name
    second = ek.build(
        trt_models.mlp(seed=1), backend="tensorrt", shapes=TWO_PROFILES[0], device="cuda",
        timing_cache=str(cache_dir),
    )  # fmt: skip
    assert second.manifest["backend"]["metadata"]["timing_cache"]["loaded"]


def test_threads_share_the_engine_safely(mlp_engine):
    engine, _ = mlp_engine
    batches = [x(rows, seed=rows) for rows in (3, 40, 3, 40, 17, 90)]
    want = [engine.infer(b)["y"] for b in batches]
    futures = [engine.infer_async(b) for b in batches]
    for f, w in zip(futures, want):
        np.testing.assert_array_equal(f.result()["y"], w)


def test_torch_cuda_tensors_go_in_and_out_without_a_host_round_trip(mlp_engine):
    torch = pytest.importorskip("torch", reason="torch checks the CUDA array path")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    engine, _ = mlp_engine
    host = x(20, seed=7)
    want = engine.infer(host)["y"]
    on_gpu = torch.from_numpy(host["x"]).cuda()
    got = engine.infer_cuda({"x": on_gpu})["y"]
    np.testing.assert_allclose(torch.as_tensor(got, device="cuda").cpu().numpy(), want)
    out = torch.empty((20, 4), device="cuda")
    result = engine.infer_cuda(on_gpu, out={"y": out})
    assert result["y"] is out
    np.testing.assert_allclose(out.cpu().numpy(), want)
    np.testing.assert_allclose(engine.infer(on_gpu)["y"], want)  # CUDA in, numpy out
