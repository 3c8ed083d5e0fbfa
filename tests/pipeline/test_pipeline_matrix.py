"""The build matrix: every entry built, a second run all cache hits with no backend work,
unavailable backends skipped, parallel builds in spawned processes, reproducible manifests."""

from __future__ import annotations

import inspect
import json
import os
import zipfile
from pathlib import Path

import pytest

import enginekit as ek
from enginekit import backends
from enginekit.pipeline import run

from .helpers import MLP_SHAPES

NO_BENCH = "[bench]\nenabled = false\n"


def cpu_backends() -> list[str]:
    """Registered backends that can build for the CPU here, TVM first when it can."""
    names = [a.name for a in ek.available_backends() if a.available and "cpu" in a.devices]
    return sorted(names, key=lambda n: n != "tvm")


def two_entries(backend: str) -> str:
    """An [[engine]] table giving two entries of one backend: two precisions where it lists
    them (a backend that lists none is taken to build fp32 only), else two layouts, else two
    option variants."""
    module = backends.get(backend)
    listed = getattr(module, "PRECISIONS", ("fp32",))
    precisions = [p for p in ("fp32", "fp16") if p in listed]
    table = f'[[engine]]\nbackend = "{backend}"\n'
    if len(precisions) == 2:
        return table + f"precision = {json.dumps(precisions)}\n"
    if "layout" in getattr(module, "OPTIONS", {}):
        return table + 'layout = ["NCHW", "NHWC"]\n'
    variant = table + 'variant = "v2"\noptions = { optimization_level = "basic" }\n'
    return table + "\n" + variant


def matrix_engines() -> tuple[str, list[str]]:
    """[[engine]] tables for two backends x two entries each, from what is available here:
    ONNX Runtime option variants stand in for a second backend when there is none."""
    chosen = cpu_backends()[:2]
    tables = [two_entries(name) for name in chosen]
    if len(chosen) < 2:
        tables.append(
            '[[engine]]\nbackend = "onnxruntime"\nvariant = "extended"\n'
            'options = { optimization_level = "extended" }\n'
            '[[engine]]\nbackend = "onnxruntime"\nvariant = "disable"\n'
            'options = { optimization_level = "disable" }\n'
        )
    return "\n".join(tables), chosen


@pytest.fixture
def count_backend_builds(monkeypatch):
    """Counts calls of every backend's build() (the calls still happen)."""
    calls: list[str] = []
    for name in cpu_backends():
        module = backends.get(name)
        real = module.build

        def counting(model, config, workdir, _real=real):
            calls.append(config.backend)
            return _real(model, config, workdir)

        monkeypatch.setattr(module, "build", counting)
    return calls


@pytest.mark.slow
def test_second_run_is_all_cache_hits_without_backend_work(project, count_backend_builds):
    engines, chosen = matrix_engines()
    path = project.write(f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}{engines}\n{NO_BENCH}')
    out, cache = project.root / "dist", project.root / "cache"

    cold = run(path, out=out, cache=cache)
    assert cold["exit_code"] == 0, cold["entries"]
    ids = [e["id"] for e in cold["entries"]]
    assert len(ids) == 4 and all(e["cache"] == "miss" for e in cold["entries"])
    assert len(count_backend_builds) == 4
    built = {i: (out / f"{i}.ekit").read_bytes() for i in ids}

    warm = run(path, out=out, cache=cache)
    assert warm["exit_code"] == 0
    assert [(e["id"], e["status"], e["cache"]) for e in warm["entries"]] == [
        (i, "cached", "hit") for i in ids
    ]
    assert len(count_backend_builds) == 4, "the warm run called a backend's build()"
    assert {i: (out / f"{i}.ekit").read_bytes() for i in ids} == built
    for i in ids:
        with ek.load(out / f"{i}.ekit") as engine:
            assert engine.infer(np_batch())["output"].shape == (2, 4)
    share = warm["timings"]["build_s"] / cold["timings"]["build_s"]
    # With a compiling backend (TVM) in the matrix the warm build phase is a few file copies
    # against minutes of compilation; ONNX Runtime alone builds in a fraction of a second, so
    # there the bound is looser.
    print(f"warm/cold build phase: {share:.3f} ({chosen or ['onnxruntime variants']})")
    assert share <= (0.05 if "tvm" in chosen else 0.5), (share, warm["timings"], cold["timings"])
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["cached"] == 4
    assert "| `" + ids[0] + "` | cached | hit |" in (out / "report.md").read_text()


def np_batch():
    import numpy as np

    return {"x": np.ones((2, 16), np.float32)}


def test_changed_options_miss_only_their_entry(project):
    text = f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        options = {{ intra_op_threads = THREADS }}
        [[engine]]
        backend = "onnxruntime"
        variant = "basic"
        options = {{ optimization_level = "basic" }}
        {NO_BENCH}
        """
    out, cache = project.root / "dist", project.root / "cache"
    run(project.write(text.replace("THREADS", "1")), out=out, cache=cache)
    again = run(project.write(text.replace("THREADS", "2")), out=out, cache=cache)
    assert [e["cache"] for e in again["entries"]] == ["miss", "hit"]


def test_changed_model_misses_the_cache(project):
    text = (
        f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "onnxruntime"\n{NO_BENCH}'
    )
    path = project.write(text)
    out, cache = project.root / "dist", project.root / "cache"
    first = run(path, out=out, cache=cache)
    second = run(path, out=out, cache=cache)
    assert second["entries"][0]["cache"] == "hit"
    from onnx import numpy_helper

    model = ek.load_model(project.root / "mlp.onnx")

    w = numpy_helper.to_array(model.proto.graph.initializer[0]).copy()
    w.flat[0] += 1.0
    model.proto.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(w, model.proto.graph.initializer[0].name)
    )
    model.save(project.root / "mlp.onnx")
    third = run(path, out=out, cache=cache)
    assert third["entries"][0]["cache"] == "miss"
    assert third["entries"][0]["key"] != first["entries"][0]["key"]


def test_unavailable_backend_is_skipped_with_reason_or_fails_when_strict(project):
    if backends.availability("tensorrt").available:
        pytest.skip("TensorRT is available here: nothing to skip")
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        [[engine]]
        backend = "tensorrt"
        {NO_BENCH}
        """
    )
    report = run(path, out=project.root / "dist")
    assert report["exit_code"] == 0
    skipped = report["entries"][1]
    assert skipped["status"] == "skipped" and "not available here" in skipped["reason"]
    assert not (project.root / "dist" / "mlp-tensorrt-fp32.ekit").exists()
    strict = run(path, out=project.root / "dist2", strict=True)
    assert strict["exit_code"] == 1 and strict["entries"][1]["status"] == "failed"
    assert strict["entries"][0]["status"] == "built"


@pytest.mark.slow
def test_parallel_jobs_build_in_spawned_processes(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        precision = ["fp32", "fp16"]
        {NO_BENCH}
        """
    )
    report = run(path, out=project.root / "dist", jobs=2)
    assert [e["status"] for e in report["entries"]] == ["built", "built"]
    pids = {e["pid"] for e in report["entries"]}
    assert os.getpid() not in pids and len(pids) == 2


def test_failed_entry_does_not_stop_the_others(project, broken_backend):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "broken"
        [[engine]]
        backend = "onnxruntime"
        options = {{ providers = ["nope"] }}
        [[engine]]
        backend = "onnxruntime"
        variant = "ok"
        {NO_BENCH}
        """
    )
    report = run(path, out=project.root / "dist")
    statuses = [(e["status"], e["failure"]) for e in report["entries"]]
    assert statuses == [("failed", "verification"), ("failed", "error"), ("built", None)]
    assert "provider 'nope'" in report["entries"][1]["reason"]
    assert report["exit_code"] == 1


def without_times(data):
    """A manifest without its timestamps (``created``) and durations (numbers under keys named
    ``seconds`` or ending in ``_s``, the project's naming of seconds)."""
    if isinstance(data, dict):
        return {
            k: without_times(v)
            for k, v in data.items()
            if k != "created"
            and not ((k == "seconds" or k.endswith("_s")) and isinstance(v, (int, float)))
        }
    if isinstance(data, list):
        return [without_times(v) for v in data]
    return data


def manifest(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("manifest.json"))


def test_two_builds_of_one_entry_differ_only_in_timestamps(project):
    # Choices a backend measures at build time (XLA's compiler flags) are pinned: a measured
    # choice may differ between two builds, and the manifest records it either way.
    pinned = {"xla": 'options = { xla_flags = "xla-default" }\n'}
    engines = "".join(
        f'[[engine]]\nbackend = "{name}"\n{pinned.get(name, "")}' for name in cpu_backends()
    )
    path = project.write(f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}{engines}\n{NO_BENCH}')
    a = run(path, out=project.root / "a")
    b = run(path, out=project.root / "b")
    for ea, eb in zip(a["entries"], b["entries"]):
        ma, mb = manifest(Path(ea["artifact"])), manifest(Path(eb["artifact"]))
        assert without_times(ma) == without_times(mb), ea["id"]
        # What a rebuild needs is recorded: the source, the whole config, the versions.
        assert ma["source"]["sha256"] and ma["config"]["backend"] == ea["backend"]
        assert ma["backend"]["version"] and ma["enginekit_version"] and ma["build"]["versions"]


ZOO = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def make_net():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 16),)
"""


@pytest.mark.slow
def test_exporter_entry_is_exported_then_built(project, monkeypatch):
    pytest.importorskip("torch", reason="the exporter entry returns a torch module")
    import sys

    (project.root / "cizoo").mkdir()
    (project.root / "cizoo" / "__init__.py").write_text("")
    (project.root / "cizoo" / "nets.py").write_text(ZOO)
    for name in ("cizoo", "cizoo.nets"):  # imported by this test only; gone afterwards
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    path = project.write(
        f"""
        [model]
        source = "cizoo.nets:make_net"
        export = {{ dynamic_batch = true }}
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        {NO_BENCH}
        """
    )
    out, cache = project.root / "dist", project.root / "cache"
    first = run(path, out=out, cache=cache)
    assert first["exit_code"] == 0, first["entries"]
    assert (out / "nets.onnx").is_file() and (out / "nets-onnxruntime-fp32.ekit").is_file()
    assert first["model"]["sha256"] == ek.load_model(out / "nets.onnx").sha256
    # The export is deterministic, so an unchanged entry function is a cache hit.
    assert run(path, out=out, cache=cache)["entries"][0]["cache"] == "hit"


def test_exporter_entry_that_cannot_be_found_is_a_config_error(project):
    from enginekit.pipeline import ConfigError, load

    path = project.write(
        '[model]\nsource = "nowhere.nets:make_net"\n[[engine]]\nbackend = "onnxruntime"\n'
    )
    with pytest.raises(ConfigError, match=r"enginekit.toml:2: model.source: cannot find module"):
        load(path)


def test_skipped_entry_leaves_no_stale_artifact(project, broken_backend):
    ok = f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "broken"\natol = 100.0\n{NO_BENCH}'
    out = project.root / "dist"
    assert run(project.write(ok), out=out)["entries"][0]["status"] == "built"
    strict = ok.replace("atol = 100.0\n", "")
    report = run(project.write(strict), out=out)
    assert report["entries"][0]["status"] == "failed"
    assert not (out / "mlp-broken-fp32.ekit").exists()


def int8_ready() -> bool:
    return "calib_data" in inspect.signature(ek.build).parameters and "int8" in getattr(
        backends.get("onnxruntime"), "PRECISIONS", ()
    )


@pytest.mark.skipif(not int8_ready(), reason="needs enginekit's INT8 calibration")
def test_int8_entry_is_calibrated_gated_and_keyed_by_its_data(project):
    import numpy as np

    calib = project.root / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(calib / f"b{i}.npy", rng.standard_normal((16, 16)).astype(np.float32))
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        precision = ["fp32", "int8"]
        [calibration]
        data = "calib/*.npy"
        method = "minmax"
        [gates]
        max_abs_error = {{ fp32 = 1e-4, int8 = 0.5 }}
        min_top1_agreement = {{ int8 = 0.5 }}
        {NO_BENCH}
        """
    )
    out, cache = project.root / "dist", project.root / "cache"
    report = run(path, out=out, cache=cache)
    fp32, int8 = report["entries"]
    assert fp32["status"] == int8["status"] == "built", int8["reason"]
    assert (
        "held-out" in int8["accuracy"]["data"]
        and fp32["accuracy"]["data"] != int8["accuracy"]["data"]
    )
    assert int8["accuracy"]["top1_agreement"] is not None
    assert {g["gate"] for g in int8["gates"]} == {"max_abs_error", "min_top1_agreement"}
    assert report["exit_code"] == 0, report["regressions"]
    with ek.load(out / f"{int8['id']}.ekit") as engine:
        assert engine.manifest["calibration"] is not None
    assert [e["cache"] for e in run(path, out=out, cache=cache)["entries"]] == ["hit", "hit"]
    np.save(calib / "b0.npy", rng.standard_normal((16, 16)).astype(np.float32))
    again = run(path, out=out, cache=cache)
    assert [e["cache"] for e in again["entries"]] == ["hit", "miss"]  # only int8 reads the data
