"""Ray Data: ``ek.ray.map_engine`` on a local 2-CPU cluster agrees with ``infer_dataset`` row
for row, ``infer_dataset(ray=...)`` writes the same shards, and killing an actor process mid-run
loses and duplicates no row (Ray restarts the actor and retries its in-flight batches)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from dataset_helpers import cnn_rows, read_output, tensor_column, write_parquet

import enginekit as ek

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")

ray = pytest.importorskip("ray", reason="enginekit[ray] is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("raydata")
    x = cnn_rows(120, seed=5)
    # One file of several row groups: ray.data.read_parquet lists many paths on threads that
    # race importing fsspec's HTTP filesystem when aiohttp is missing (a Ray issue).
    write_parquet(
        folder / "src" / "data.parquet",
        {"key": [f"k{j}" for j in range(120)], "x": tensor_column(x)},
        row_group_size=16,
    )
    return folder


def test_map_engine_matches_infer_dataset_row_for_row(cluster, ekit, parquet):
    artifact = ekit("cnn")
    local = ek.infer_dataset(artifact, parquet / "src", parquet / "local", batch_size=8)
    expected = read_output(parquet / "local")
    ds = ray.data.read_parquet(str(parquet / "src"))
    for compute in ("actors", "tasks"):
        rows = ek.ray.map_engine(ds, artifact, batch_size=8, compute=compute).take_all()
        assert len(rows) == local.rows == 120
        by_key = {r["key"]: r["output"] for r in rows}
        assert sorted(by_key) == sorted(expected["key"].tolist())
        for key, out in zip(expected["key"], expected["output"]):
            np.testing.assert_array_equal(by_key[key], out)
    # Through infer_dataset(ray=...): Ray computes, the driver commits the same shards as a
    # local run. Here it resumes a local run that stopped after its first shard (the ledger as
    # a kill there leaves it): Ray reads only the row groups from row 32 on; the output is the
    # same as the uninterrupted local run.
    import json

    from enginekit.dataset.ledger import NAME

    ek.infer_dataset(artifact, parquet / "src", parquet / "mixed", batch_size=8, shard_rows=32)
    ledger = json.loads((parquet / "mixed" / NAME).read_text())
    ledger["shards"], ledger["complete"] = ledger["shards"][:1], False
    (parquet / "mixed" / NAME).write_text(json.dumps(ledger))
    s = ek.infer_dataset(artifact, parquet / "src", parquet / "mixed", ray=True, resume=True)
    assert (s.shards_skipped, s.shards_written, s.rows_inferred, s.ray) == (1, 3, 88, "local")
    got = read_output(parquet / "mixed")
    assert got["key"].tolist() == expected["key"].tolist()
    np.testing.assert_array_equal(got["output"], expected["output"])


def _engine_pids(name: str) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"MapBatches({name})" in cmd:
            pids.append(p.pid)
    return pids


@pytest.mark.parametrize("compute", ["actors", "tasks"])
def test_killing_an_engine_process_mid_run_loses_and_duplicates_no_row(cluster, ekit, compute):
    artifact = ekit("cnn")
    n = 600

    # Defined here, not at module level: Ray pickles a local function by value (the workers
    # cannot import this test module).
    def _slow_features(batch: dict) -> dict:
        time.sleep(0.05)  # stretch the run so that the kill lands while batches are in flight
        ids = batch["id"]
        x = np.stack([np.random.default_rng(int(i)).standard_normal((3, 16, 16)) for i in ids])
        return {"id": ids, "x": x.astype(np.float32)}

    ds = ray.data.range(n, override_num_blocks=60).map_batches(_slow_features, batch_size=None)
    mapped = ek.ray.map_engine(
        ds, artifact, batch_size=4, concurrency=2, num_cpus=0.5, compute=compute
    )
    seen: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    killed = None
    for batch in mapped.iter_batches(batch_size=10, batch_format="numpy"):
        seen.append(batch["id"])
        outputs.append(batch["output"])
        if killed is None and len(seen) == 3:
            # A task's worker carries the task's name only while it runs one: wait for it.
            name = "EngineActor" if compute == "actors" else "map_block"
            deadline = time.monotonic() + 10
            while not (pids := _engine_pids(name)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pids, "no engine process found"
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
    assert killed is not None and sum(map(len, seen)) > 30, "the kill did not land mid-run"
    ids = np.concatenate(seen)
    assert sorted(ids.tolist()) == list(range(n))  # every row exactly once
    with ek.load(artifact) as engine:
        x = np.stack(
            [np.random.default_rng(int(i)).standard_normal((3, 16, 16)) for i in ids]
        ).astype(np.float32)
        np.testing.assert_allclose(
            np.concatenate(outputs), engine.infer(x)["output"], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("compute", ["actors", "tasks"])
def test_reads_are_fused_into_the_engine_actors_or_tasks(cluster, ekit, parquet, compute):
    # Unfused, every block of inputs goes through the object store. Ray Data fuses two task
    # operators only when their pools have the same size: read_dataset(concurrency=).
    from enginekit.dataset.ray import read_dataset
    from enginekit.dataset.resolve import open_source

    artifact = ekit("cnn")
    with ek.load(artifact) as engine:
        src = open_source(parquet / "src", engine.inputs)
    pool = 2 if compute == "tasks" else None
    mapped = ek.ray.map_engine(
        read_dataset(src, 40, concurrency=pool), artifact, batch_size=None,
        batch_format="pyarrow", compute=compute, concurrency=pool or 1,
    ).materialize()  # fmt: skip
    stats = mapped.stats()
    name = "EngineActor" if compute == "actors" else "map_block"
    assert f"MapBatches(read_row_groups)->MapBatches({name})" in stats
    assert mapped.count() == 80  # from row 40 on


def _in_row_order(blocks) -> list:
    """Blocks of keys ``k<row>`` sorted by their first row."""
    return sorted(blocks, key=lambda keys: int(str(keys[0])[1:]))


def test_read_blocks_end_on_the_engine_batch_grid(cluster, ekit, parquet):
    from enginekit.dataset.ray import read_dataset
    from enginekit.dataset.resolve import open_source

    with ek.load(ekit("cnn")) as engine:
        src = open_source(parquet / "src", engine.inputs)
    # Row groups of 16 rows, engine batches of 6 from row 10: blocks end at 10 + 6k.
    # Ray may hand finished blocks over out of order (seen under load): put them in row order.
    blocks = _in_row_order(b["key"] for b in read_dataset(src, 10, 6).iter_batches(batch_size=None))
    assert all(len(b) % 6 == 0 for b in blocks[:-1]) and len(blocks) > 1
    assert np.concatenate(blocks).tolist() == [f"k{j}" for j in range(10, 120)]
    # Blocks of several row groups: each ends at the first group end (on the grid) at least
    # 40 rows on, the last takes what is left.
    ds = read_dataset(src, 10, 6, block_rows=40)
    sizes = [len(b) for b in _in_row_order(b["key"] for b in ds.iter_batches(batch_size=None))]
    assert sizes == [42, 48, 20] and sum(sizes) == 110
    # Or as many blocks as asked (a whole number of rounds of one per CPU), of about equal
    # rows: 42 + 48 + 20 left the last round's second CPU idle.
    ds = read_dataset(src, 10, 6, blocks=2)
    sizes = [len(b) for b in _in_row_order(b["key"] for b in ds.iter_batches(batch_size=None))]
    assert sizes == [54, 56]


def test_ray_job_blocks_shrink_towards_the_end(ekit, parquet):
    from enginekit.dataset.ray import block_pieces
    from enginekit.dataset.resolve import open_source

    with ek.load(ekit("cnn")) as engine:
        src = open_source(parquet / "src", engine.inputs)
    # From row 10, batches of 6, two CPUs: each block ends at the first cut (a row group end
    # on the grid) at least half the rows left on, 12 to 48 rows: 110 rows left, 48 wanted,
    # cut at 64; 56 left, 28 wanted, cut at 100; 20 left, 12 wanted; the last 8.
    blocks = block_pieces(src, 10, 6, shrink=(2, 12, 48))
    assert [sum(p[3] for p in b) for b in blocks] == [54, 36, 12, 8]
    assert blocks[0][0][1:3] == (0, 10) and blocks[-1][-1][1:] == (7, 0, 8)


def test_ray_job_tasks_claim_blocks_first_come_and_a_retry_replays_its_own(cluster):
    # --ray's tasks take blocks as they go (a faster CPU takes more); a task that runs again
    # after its process died must yield its earlier blocks again, in the same order, before
    # new ones, so that Ray can drop the copies of outputs the driver already took.
    from enginekit.dataset.ray_job import _claims, _forget

    job = "enginekit/test-claims"
    first, second = _claims(job, 0, 6), _claims(job, 1, 6)
    assert [next(first), next(second), next(second), next(first)] == [0, 1, 2, 3]
    retry = _claims(job, 0, 6)  # task 0's process died after block 3
    assert [next(retry), next(retry), next(retry)] == [0, 3, 4]
    assert list(second) == [5] and list(retry) == []
    _forget(job)
    assert list(_claims(job, 1, 2)) == [0, 1]  # a forgotten job's blocks are free again
    _forget(job)


def test_ray_job_driver_cuts_joined_blocks_into_runs_of_rows():
    # Ray Data may join two output blocks of one task (rows 5-7 and 20-21): the driver puts
    # each run in its place.
    from enginekit.dataset.ray_job import ROW, _runs

    batch = {ROW: np.array([5, 6, 7, 20, 21]), "y": np.arange(10).reshape(5, 2)}
    runs = list(_runs(batch))
    assert [(first, part[ROW].tolist()) for first, part in runs] == [(5, [5, 6, 7]), (20, [20, 21])]
    np.testing.assert_array_equal(runs[1][1]["y"], [[6, 7], [8, 9]])


def test_actor_runs_a_ray_batch_as_engine_batches(ekit):
    from enginekit.dataset.ray import EngineActor, _sha256

    artifact = ekit("cnn")
    x = cnn_rows(20, seed=3)
    actor = EngineActor(None, str(artifact), _sha256(artifact), {}, False, False, None, 8, 1)
    calls = []
    infer = actor.engine.infer
    actor.engine.infer = lambda feeds: calls.append(len(feeds["x"])) or infer(feeds)
    got = actor({"x": x})
    assert calls == [8, 8, 4]
    np.testing.assert_array_equal(
        got["output"], np.concatenate([infer({"x": x[i : i + 8]})["output"] for i in (0, 8, 16)])
    )


def test_map_engine_refuses_a_bad_thread_count_before_touching_ray(ekit):
    with pytest.raises(ek.errors.UsageError, match="threads 0: expected an integer >= 1"):
        ek.ray.map_engine(None, ekit("cnn"), threads=0)


def test_an_actor_process_imports_no_more_of_enginekit_than_it_runs():
    # Each Ray Data actor is a new process that imports enginekit.dataset.ray and a backend at
    # every job's start: the build, batcher, calibration and evaluation layers stay unloaded.
    import subprocess
    import sys

    code = (
        "import sys, enginekit.dataset.ray, enginekit.backends.onnxruntime; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('enginekit'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "enginekit.dataset.ray" in loaded
    heavy = (
        "build",
        "batcher",
        "calibration",
        "evaluate",
        "passes",
        "dataset.run",
        "dataset.autobatch",
    )
    assert not {m for m in loaded for h in heavy if m.startswith(f"enginekit.{h}")}


def test_a_task_process_keeps_one_engine_between_datasets(ekit, tmp_path):
    # compute="tasks": each worker process loads the artifact on its first block and keeps it
    # for the next blocks and datasets; another artifact (or setting) replaces it.
    from enginekit.dataset import ray as ray_mod

    artifact = ekit("cnn")
    args = (None, str(artifact), ray_mod._sha256(artifact), {}, False, False, None, None, 1)
    x = cnn_rows(4, seed=1)
    ray_mod._CACHED.clear()
    first = ray_mod.map_block({"x": x}, args)["output"]
    (mapper,) = ray_mod._CACHED.values()
    np.testing.assert_array_equal(ray_mod.map_block({"x": x}, args)["output"], first)
    assert list(ray_mod._CACHED.values()) == [mapper]
    ray_mod.map_block({"x": x}, (*args[:-1], 2))  # two threads: another engine
    (other,) = ray_mod._CACHED.values()
    assert other is not mapper
    with pytest.raises(ek.errors.UsageError, match="compute 'pool': expected 'actors' or 'tasks'"):
        ek.ray.map_engine(None, artifact, compute="pool")
    ray_mod._CACHED.clear()


def test_killing_a_ray_job_task_after_its_first_block_loses_and_duplicates_no_row(
    cluster, ekit, tmp_path, monkeypatch
):
    # infer_dataset(ray=...) runs one task per CPU that claims blocks as it goes and yields
    # their outputs one by one: killed after the driver has taken the first block, a task runs
    # again and yields the blocks it claimed before, then claims more; the driver must see
    # each row once, in order, with the local run's outputs.
    import psutil

    from enginekit.dataset import ray_job
    from enginekit.dataset.resolve import open_source

    artifact = ekit("cnn")
    n = 2400
    write_parquet(
        tmp_path / "src" / "data.parquet",
        {"key": [f"k{j}" for j in range(n)], "x": tensor_column(cnn_rows(n, seed=7))},
        row_group_size=10,
    )
    local = read_output(ek.infer_dataset(artifact, tmp_path / "src", tmp_path / "local", 6).output)
    with ek.load(artifact) as engine:
        src = open_source(tmp_path / "src", engine.inputs)
        outputs = engine.outputs
    # Blocks of up to 30 rows (about 80), so that each task still runs when the first arrives.
    monkeypatch.setattr(ray_job, "BLOCK_BYTES", 30 * ray_job._row_bytes(src.inputs))
    keys, outs, killed = [], [], []
    for batch, out in ray_job.ray_batches(artifact, src, 0, 6, 60, True, outputs):
        keys.extend(batch.piece.ids["key"].to_pylist())
        outs.append(out["output"])
        if not killed:
            deadline = time.monotonic() + 10
            while not killed and time.monotonic() < deadline:
                for p in psutil.process_iter(["cmdline"]):
                    if "MapBatches(read_and_map)" in " ".join(p.info["cmdline"] or []):
                        os.kill(p.pid, signal.SIGKILL)
                        killed.append(p.pid)
    assert killed, "no task was running after the first block"
    assert keys == local["key"].tolist()  # every row once, in order
    np.testing.assert_array_equal(np.concatenate(outs), local["output"])
