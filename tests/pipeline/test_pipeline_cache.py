"""The artifact cache: shared by concurrent jobs without corruption, pruned least recently used
first, corrupt entries evicted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enginekit.artifact import open_artifact
from enginekit.cli import main
from enginekit.errors import EnginekitError
from enginekit.pipeline import Cache, run
from enginekit.pipeline.cache import parse_age, parse_size

from .helpers import MLP_SHAPES, TESTS

KEYS = [f"{i:x}" * 64 for i in range(1, 4)]


@pytest.fixture
def artifact(project):
    path = project.write(
        f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "onnxruntime"\n'
        "[bench]\nenabled = false\n"
    )
    return run(path, out=project.root / "dist")["entries"][0]["artifact"]


def test_store_then_fetch_copies_a_verified_artifact(tmp_path, artifact):
    cache = Cache(tmp_path / "c")
    with cache.lock(KEYS[0]):
        assert cache.fetch(KEYS[0], tmp_path / "out.ekit") is None
        cache.store(KEYS[0], Path(artifact), {"id": "mlp"})
        manifest = cache.fetch(KEYS[0], tmp_path / "out.ekit")
    assert manifest == open_artifact(artifact).manifest
    assert (tmp_path / "out.ekit").read_bytes() == open(artifact, "rb").read()
    assert [e.meta["id"] for e in cache.entries()] == ["mlp"]


def test_corrupt_entry_is_evicted_and_counts_as_a_miss(tmp_path, artifact):
    cache = Cache(tmp_path / "c")
    with cache.lock(KEYS[0]):
        path = cache.store(KEYS[0], Path(artifact))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with cache.lock(KEYS[0]):
        assert cache.fetch(KEYS[0], tmp_path / "out.ekit") is None
    assert not path.exists() and not (tmp_path / "out.ekit").exists()
    assert cache.evicted == [KEYS[0]]


def test_a_corrupt_cache_entry_is_reported_as_corrupt_and_rebuilt(project):
    path = project.write(
        f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "onnxruntime"\n'
        "[bench]\nenabled = false\n"
    )
    cache = project.root / "cache"
    first = run(path, out=project.root / "d1", cache=cache)
    (stored,) = Cache(cache).entries()
    data = bytearray(stored.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.path.write_bytes(bytes(data))
    second = run(path, out=project.root / "d2", cache=cache)
    assert first["entries"][0]["cache"] == "miss"
    assert second["entries"][0]["cache"] == "corrupt, rebuilt"
    assert (
        "cached artifact failed its checksums; rebuilt"
        in (project.root / "d2" / "report.md").read_text()
    )


def test_prune_removes_least_recently_used_first_and_keeps_locked(tmp_path, artifact):
    cache = Cache(tmp_path / "c")
    now = time.time()
    for age, key in zip((300, 200, 100), KEYS):
        with cache.lock(key):
            p = cache.store(key, Path(artifact))
        os.utime(p, (now - age, now - age))
    size = cache.entries()[0].size
    with cache.lock(KEYS[1]):  # fetched most recently of the old two
        cache.fetch(KEYS[1], tmp_path / "x.ekit")
    dry = cache.prune(max_size=size, dry_run=True)
    assert [e.key for e in dry.removed] == [KEYS[0], KEYS[2]] and len(cache.entries()) == 3
    with cache.lock(KEYS[0]):  # a running job holds the oldest: prune must leave it
        result = cache.prune(max_size=size)
    # The busy entry still counts towards the size, so the others go to make room.
    assert result.busy == (KEYS[0],)
    assert [e.key for e in result.removed] == [KEYS[2], KEYS[1]]
    assert [e.key for e in cache.entries()] == [KEYS[0]]
    assert cache.prune(max_age_s=50).removed[0].key == KEYS[0]


def test_prune_command(tmp_path, artifact, capsys):
    cache = Cache(tmp_path / "c")
    for key in KEYS:
        with cache.lock(key):
            cache.store(key, Path(artifact))
    assert main(["cache", "prune", "--cache", str(cache.root), "--max-size", "5GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == []
    assert main(["cache", "prune", "--cache", str(cache.root), "--max-size", "1KB"]) == 0
    assert "removed 3 entries" in capsys.readouterr().out and cache.entries() == []
    locks = list(cache.locks_dir.iterdir())
    assert len(locks) == 3  # recent: a job may be about to use them
    for lock in locks:
        os.utime(lock, (time.time() - 7200, time.time() - 7200))
    cache.prune(max_size=0)
    assert list(cache.locks_dir.iterdir()) == []
    assert main(["cache", "prune", "--cache", str(cache.root), "--max-size", "5 parsecs"]) == 2


def test_sizes_and_ages():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5GiB") == 5 * 2**30
    assert parse_size("1.5m") == 1_500_000
    assert parse_size("1024") == 1024
    assert parse_age("30d") == 30 * 86400
    for bad in ("", "GB", "-1GB", "5 XB"):
        with pytest.raises(EnginekitError):
            parse_size(bad)
    with pytest.raises(EnginekitError):
        parse_age("soon")


CONCURRENT = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from enginekit.pipeline import run
report = run({config!r}, out=sys.argv[1], cache={cache!r})
print(json.dumps([(e["id"], e["status"], e["key"]) for e in report["entries"]]))
"""


@pytest.mark.slow
def test_concurrent_builds_into_one_cache_do_not_corrupt_it(project):
    path = project.write(
        f"""
        [model]
        source = "mlp.onnx"
        {MLP_SHAPES}
        [[engine]]
        backend = "onnxruntime"
        precision = ["fp32", "fp16"]
        [[engine]]
        backend = "onnxruntime"
        variant = "basic"
        precision = ["fp32", "fp16"]
        options = {{ optimization_level = "basic" }}
        [bench]
        enabled = false
        """
    )
    cache = project.root / "cache"
    code = CONCURRENT.format(
        root=str(TESTS.parent), tests=str(TESTS), config=str(path), cache=str(cache)
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(project.root / f"out{i}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    # Each entry was built exactly once: the other job waited on its lock and got a hit.
    for a, b in zip(*results):
        assert a[0] == b[0] and a[2] == b[2]
        assert sorted((a[1], b[1])) == ["built", "cached"]
    store = Cache(cache)
    assert len(store.entries()) == 4
    for entry in store.entries():
        open_artifact(entry.path)  # every checksum matches
    assert list(store.tmp_dir.iterdir()) == []
    for i in range(2):
        leftovers = [p.name for p in (project.root / f"out{i}").iterdir() if p.name.startswith(".")]
        assert leftovers == []


def test_a_cached_entry_reuses_its_bench_result_unless_rebench(project):
    path = project.write(
        f'[model]\nsource = "mlp.onnx"\n{MLP_SHAPES}[[engine]]\nbackend = "onnxruntime"\n'
        "[bench]\nbatch_sizes = [4]\nduration = 0.1\n"
    )
    cache = project.root / "cache"
    first = run(path, out=project.root / "d1", cache=cache)["entries"][0]
    again = run(path, out=project.root / "d2", cache=cache)["entries"][0]
    assert first["cache"] == "miss" and not first["bench"].get("reused")
    assert again["cache"] == "hit" and again["bench"]["reused"] is True
    assert again["bench"]["batches"] == first["bench"]["batches"]
    assert "(reused)" in (project.root / "d2" / "report.md").read_text()
    fresh = run(path, out=project.root / "d3", cache=cache, rebench=True)["entries"][0]
    assert fresh["cache"] == "hit" and not fresh["bench"].get("reused")
    assert (
        fresh["bench"]["batches"][0]["round_throughputs"]
        != first["bench"]["batches"][0]["round_throughputs"]
    )
