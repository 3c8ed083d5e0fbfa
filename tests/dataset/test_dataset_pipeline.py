"""The pipelined run agrees with a naive loop row for row; the automatic batch size stays within
the engine's profiles and the memory budget."""

from __future__ import annotations

import time

import numpy as np
import pytest
from dataset_helpers import cnn_rows, naive, read_output, tensor_column, write_parquet

import enginekit as ek

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
from enginekit.dataset.autobatch import choose_batch_size, parse_memory, row_bytes
from enginekit.dataset.pipeline import StageTimes
from enginekit.dataset.sources import READ_BYTES, read_rows
from enginekit.engine import TensorSpec
from enginekit.errors import UsageError


def test_pipelined_run_equals_naive_loop_row_for_row_on_two_inputs(ekit, tmp_path):
    rng = np.random.default_rng(3)
    n = 203  # not a multiple of the batch or the shard
    a = rng.standard_normal((n, 8)).astype(np.float32)
    b = rng.standard_normal((n, 4)).astype(np.float32)
    for i, (lo, hi) in enumerate([(0, 60), (60, 61), (61, 203)]):
        write_parquet(
            tmp_path / "src" / f"p{i}.parquet",
            {"id": np.arange(lo, hi), "a": tensor_column(a[lo:hi]), "b": tensor_column(b[lo:hi])},
            row_group_size=17,
        )
    with ek.load(ekit("two_input")) as engine:
        s = ek.infer_dataset(
            engine, tmp_path / "src", tmp_path / "out", batch_size=8, shard_rows=40, prefetch=2
        )
        ref = naive(engine, {"a": a, "b": b}, 8)
    assert (s.rows, s.shards, s.rows_inferred) == (n, 6, n)
    got = read_output(tmp_path / "out")
    assert got["id"].tolist() == list(range(n))
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k], v)


def test_auto_batch_size_is_measured_within_the_profile(ekit, tmp_path):
    # Paced (see Limited): unpaced, at load 6 the search once stopped before batch 8.
    np.save(tmp_path / "x.npy", cnn_rows(40))
    with ek.load(ekit("cnn")) as inner:
        engine = Limited(inner, limit=8, pace=0.005)
        s = ek.infer_dataset(engine, tmp_path / "x.npy", tmp_path / "out")
    choice = s.batch_choice
    assert choice is not None and s.batch_size == choice.batch_size
    tried = [t.batch for t in choice.trials]
    assert tried == sorted(tried) and set(tried) <= {1, 2, 4, 8} and 8 in tried
    assert 1 <= s.batch_size <= 8  # the built profile's range
    best = max(t.rows_per_s for t in choice.trials)
    assert next(t.rows_per_s for t in choice.trials if t.batch == s.batch_size) >= 0.95 * best
    assert s.to_json()["batch_choice"]["trials"][0]["batch"] == 1


def test_memory_budget_caps_the_batch_search(ekit):
    with ek.load(ekit("cnn")) as engine:
        sample = {"x": cnn_rows(8)}
        per_row = row_bytes(sample, engine.infer(sample))
        choice = choose_batch_size(engine, sample, max_memory=8 * per_row * 2, seconds=0.05)
    assert choice.memory_cap == 2
    assert [t.batch for t in choice.trials] == [1, 2] and choice.batch_size <= 2
    assert "memory budget" in choice.reason


def test_memory_sizes_parse_and_bad_ones_are_refused():
    assert parse_memory("4GiB") == 4 * 2**30
    assert parse_memory("512MB") == 512_000_000
    assert parse_memory(1000) == 1000 and parse_memory(None) is None
    with pytest.raises(UsageError, match="4GiB"):
        parse_memory("lots")


def test_bad_settings_are_refused(ekit, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(4))
    with pytest.raises(UsageError, match="batch_size"):
        ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", tmp_path / "o", batch_size=0)
    with pytest.raises(UsageError, match="output format"):
        ek.infer_dataset(ekit("cnn"), tmp_path / "x.npy", tmp_path / "o", format="csv")
    with pytest.raises(UsageError, match="resume and overwrite"):
        ek.infer_dataset(
            ekit("cnn"), tmp_path / "x.npy", tmp_path / "o", resume=True, overwrite=True
        )


def test_import_enginekit_loads_neither_ray_nor_pyarrow_and_ek_ray_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, enginekit as ek; "
        "heavy = [m for m in ('ray', 'pyarrow', 'PIL') if m in sys.modules]; "
        "assert not heavy, heavy; assert callable(ek.infer_dataset)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    ray = pytest.importorskip("ray")
    assert ek.ray.map_engine.__module__ == "enginekit.dataset.ray" and ray.__name__ == "ray"


@pytest.mark.parametrize(
    ("times", "bottleneck"),
    [
        (StageTimes(infer=1.0, wait_input=0.5, wait_output=0.1), "read"),
        (StageTimes(infer=1.0, wait_input=0.05, wait_output=0.3), "write"),
        (StageTimes(infer=1.0, wait_input=0.05, wait_output=0.05), "infer"),
        (StageTimes(), "infer"),
        (StageTimes(infer=1.0, wait_output=0.5, remote=True), "write"),
        (StageTimes(infer=1.0, remote=True), "ray"),
    ],
)
def test_bottleneck_is_the_stage_the_engine_waited_on(times, bottleneck):
    assert times.bottleneck == bottleneck
    assert times.to_json()["bottleneck"] == bottleneck
    assert f"bottleneck: {bottleneck}" in times.describe()


def test_each_stage_s_times_add_up_to_the_run_s():
    read = StageTimes(read=1.0, read_cpu=0.5)
    loop = StageTimes(infer=2.0, wait_input=0.25, batches=3)
    total = read + loop + StageTimes(write=0.5, remote=True)
    assert total == StageTimes(
        read=1.0, read_cpu=0.5, infer=2.0, write=0.5, wait_input=0.25, batches=3, remote=True
    )


def test_a_slow_source_is_named_the_bottleneck_and_every_batch_is_timed(ekit, tmp_path):
    import time

    x = cnn_rows(20)

    def slow():
        for i in range(0, 20, 4):
            time.sleep(0.03)  # reading slower than the engine
            yield x[i : i + 4]

    with ek.load(ekit("cnn")) as engine:
        s = ek.infer_dataset(engine, slow(), tmp_path / "out", batch_size=4)
    st = s.stages
    assert st.batches == 5 and st.infer > 0 and st.read >= st.wait_input > 0
    assert s.bottleneck == "read" == s.to_json()["bottleneck"]
    assert s.to_json()["stages"]["batches"] == 5


def test_parquet_reads_are_whole_batches_of_about_the_read_budget():
    spec = [TensorSpec("x", "float32", ("batch", 3, 32, 32))]  # 12 KiB a row
    rows = read_rows(128, spec)
    assert rows % 128 == 0 and rows * 12288 <= READ_BYTES < (rows + 128) * 12288
    assert read_rows(4096, spec) == 4096  # at least one batch
    assert read_rows(3, [TensorSpec("t", "int64", ("batch", "seq"))]) % 3 == 0


class Limited(ek.Engine):
    """A real engine behind a device memory limit: batches above ``limit`` rows fail with the
    allocation error a GPU gives (this host has no GPU to run out of); ``slow`` batch sizes
    sleep on their first ``slow_runs`` calls, as a burst of load from elsewhere would. ``pace``
    seconds of sleep per call make rows/s grow with the batch by construction: the tiny CNN's
    own times are noise-sized, and under load a larger batch could measure slower and stop the
    search before the sizes a test is about."""

    def __init__(
        self, inner: ek.Engine, limit: int, slow: int = 0, slow_runs: int = 0, pace: float = 0.0
    ) -> None:
        super().__init__(inner.inputs, inner.outputs, inner.profiles, inner.manifest)
        self.inner, self.limit, self.slow, self.slow_runs = inner, limit, slow, slow_runs
        self.pace = pace
        self.calls: list[int] = []

    def _run(self, feeds):
        n = len(next(iter(feeds.values())))
        self.calls.append(n)
        if n > self.limit:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {n} MiB")
        if n == self.slow and self.calls.count(n) <= self.slow_runs:
            time.sleep(0.05)
        if self.pace:
            time.sleep(self.pace)
        return self.inner.infer(feeds)


def test_batch_search_stops_at_the_memory_limit_and_records_it(ekit):
    with ek.load(ekit("cnn")) as inner:
        engine = Limited(inner, limit=4, pace=0.005)
        choice = choose_batch_size(engine, {"x": cnn_rows(8)}, seconds=0.04)
    assert [t.batch for t in choice.trials] == [1, 2, 4, 8]
    assert choice.oom_retries == 1 and choice.batch_size <= 4
    assert choice.trials[-1].rows_per_s is None
    assert choice.trials[-1].error.startswith("out of memory: ")
    assert all(len(t.measured) >= 2 for t in choice.trials[:3])  # measured twice each


def test_batch_search_does_not_stop_on_one_slowed_run(ekit):
    # Batch 2's first short runs are slowed far below batch 1 (as by a burst of load): the
    # first pass measures it again before it stops, and the search still reaches the top.
    with ek.load(ekit("cnn")) as inner:
        engine = Limited(inner, limit=8, slow=2, slow_runs=3, pace=0.005)
        choice = choose_batch_size(engine, {"x": cnn_rows(8)}, seconds=0.04)
    assert [t.batch for t in choice.trials] == [1, 2, 4, 8]
    two = choice.trials[1]
    assert two.rows_per_s == max(two.measured) and min(two.measured) < two.rows_per_s


def test_a_batch_that_runs_out_of_memory_is_halved_and_retried(ekit, tmp_path):
    x = cnn_rows(40)
    np.save(tmp_path / "x.npy", x)
    with ek.load(ekit("cnn")) as inner:
        engine = Limited(inner, limit=4)
        s = ek.infer_dataset(engine, tmp_path / "x.npy", tmp_path / "out", batch_size=8)
        ref = naive(inner, {"x": x}, 4)
    assert s.oom_retries == 5 and s.rows == 40  # each batch of 8 ran as two halves of 4
    np.testing.assert_array_equal(read_output(tmp_path / "out")["output"], ref["output"])


def test_ledger_saved_once_before_the_first_shard_and_once_per_shard(ekit, tmp_path, monkeypatch):
    # Each save is an fsync on the job's start or its tail: the first save carries how the
    # engine runs, and the last shard's commit marks the output complete. The first is made
    # by the writer thread (its fsync overlaps the first read, not before the engine starts),
    # and still before any shard file exists: exactly-once needs no shard without a ledger.
    import threading

    from enginekit.dataset import ledger, sinks

    np.save(tmp_path / "x.npy", cnn_rows(20))
    events = []
    real_save, real_write = ledger.Ledger.save, sinks.write_shard

    def save(self):
        events.append(("save", self.complete, threading.current_thread().name))
        real_save(self)

    def write(path, *args, **kwargs):
        events.append(("shard", (path.parent / ledger.NAME).exists(), None))
        real_write(path, *args, **kwargs)

    monkeypatch.setattr(ledger.Ledger, "save", save)
    monkeypatch.setattr("enginekit.dataset.pipeline.write_shard", write)
    with ek.load(ekit("cnn")) as engine:
        s = ek.infer_dataset(
            engine, tmp_path / "x.npy", tmp_path / "out", 4, shard_rows=8, streams=2
        )
    assert (s.rows, s.shards) == (20, 3)
    writer = "enginekit-write"
    assert events == [
        ("save", False, writer),  # start, on the writer's thread
        *[("shard", True, None), ("save", False, writer)] * 2,  # 2 shards
        ("shard", True, None), ("save", True, writer),  # last shard + complete
    ]  # fmt: skip
    found = ledger.Ledger.read(tmp_path / "out")
    assert found is not None and found.complete and found.engine["streams"] == 2


def test_parquet_read_buffers_are_reused_only_when_no_batch_views_them(tmp_path):
    # A new read buffer is new memory the kernel zeroes as the reader first writes it (half
    # the reader's page faults); a buffer a batch still views must never be written again.
    from enginekit.dataset.parquet import BufferPool, ParquetSource

    rows = cnn_rows(64)
    path = write_parquet(tmp_path / "p.parquet", {"x": tensor_column(rows)}, row_group_size=8)
    spec = [TensorSpec("x", "float32", ("batch", 3, 16, 16))]
    src = ParquetSource(path, spec, None, None, False)
    held, at, count = [], 0, 0
    for i, piece in enumerate(src.pieces(0, 4)):
        if i % 3 == 0:
            held.append((at, piece.inputs["x"]))  # in use: never handed out again
        at += piece.rows
        count += 1
    assert at == 64 and src.groups_fast == 8 and count == 9
    # New buffers: the held pieces', the first two pieces' (smaller), and one or two that went
    # round (``piece`` still names the last piece while the next is read).
    assert len(src._buffers._free["x"]) <= len(held) + 3 < count - 2
    for at, x in held:
        np.testing.assert_array_equal(x, rows[at : at + len(x)])
    src.close()
    assert not src._buffers._free  # closed: nothing kept
    pool = BufferPool(2)
    a = pool.get("x", 10, np.float32)
    b = pool.get("x", 10, np.float32)
    assert not np.shares_memory(a, b)  # ``a`` is alive
    del a
    assert np.shares_memory(pool.get("x", 8, np.float32), pool._free["x"][0])  # reused
    c = pool.get("x", 10, np.float64)  # another dtype: a new one, not kept (2 slots)
    assert c.dtype == np.float64 and len(pool._free["x"]) == 2


def test_parquet_first_pieces_are_one_batch_then_whole_reads(tmp_path):
    # The engine (and a second stream) start on one batch each instead of waiting for a whole
    # read (READ_BYTES); across row groups too.
    from enginekit.dataset.parquet import EARLY_PIECES, ParquetSource

    assert EARLY_PIECES == 2
    path = write_parquet(
        tmp_path / "p.parquet", {"x": tensor_column(cnn_rows(300))}, row_group_size=300
    )
    spec = [TensorSpec("x", "float32", ("batch", 3, 16, 16))]
    src = ParquetSource(path, spec, None, None, False)
    step = read_rows(4, spec)
    sizes = [p.rows for p in src.pieces(0, 4)]
    assert sizes[:3] == [4, 4, min(step, 292)] and sum(sizes) == 300 and src.groups_fast == 1
    path = write_parquet(
        tmp_path / "q.parquet", {"x": tensor_column(cnn_rows(20))}, row_group_size=4
    )
    sizes = [p.rows for p in ParquetSource(path, spec, None, None, False).pieces(0, 2)]
    assert sizes == [2, 2, 4, 4, 4, 4]


def test_threads_are_handed_a_read_and_a_shard_at_a_time_not_a_batch(ekit, tmp_path, monkeypatch):
    # Each hand-off wakes a thread that takes a core from the engine mid-call: on 2 cores the
    # per-batch hand-offs preempted the engine's threads ~900 times per 40k rows. The reader
    # queues all the batches of one read at once (the first two reads are one batch), the writer
    # gets whole shards, and the streams take their batches themselves (no dispatcher).
    from enginekit.dataset import pipeline
    from enginekit.dataset.batches import BatchQueue

    path = write_parquet(
        tmp_path / "p.parquet", {"x": tensor_column(cnn_rows(120))}, row_group_size=120
    )
    spec = [TensorSpec("x", "float32", ("batch", 3, 16, 16))]
    step = read_rows(4, spec) // 4  # batches per read
    reads, shards, writer_wakes = [], [], []
    put, commit, writer_get = BatchQueue.put, pipeline._commit, pipeline._get

    def spy_put(self, chunk, stop):
        reads.append(len(chunk))
        return put(self, chunk, stop)

    def spy_commit(parts, shard, *args):
        shards.append(len(parts))
        return commit(parts, shard, *args)

    monkeypatch.setattr(BatchQueue, "put", spy_put)
    monkeypatch.setattr(pipeline, "_get", lambda q, st: writer_wakes.append(1) or writer_get(q, st))
    monkeypatch.setattr(pipeline, "_commit", spy_commit)
    with ek.load(ekit("cnn")) as engine:
        s = ek.infer_dataset(engine, path, tmp_path / "out", 4, shard_rows=40, streams=2)
        ref = naive(engine, {"x": cnn_rows(120)}, 4)
    assert (s.rows, s.shards, s.stages.batches) == (120, 3, 30)
    assert reads[:3] == [1, 1, min(step, 28)] and sum(reads) == 30
    assert shards == [10, 10, 10] and len(writer_wakes) == 4  # 3 shards and the end, not 30
    np.testing.assert_array_equal(read_output(tmp_path / "out")["output"], ref["output"])


def test_the_reader_waiting_for_room_is_not_counted_as_reading(ekit, tmp_path):
    # A fast source ahead of a slow engine: the reader spends the run waiting for room in the
    # inbox, which must not make reading look like the bottleneck's twin.
    x = cnn_rows(20)
    with ek.load(ekit("cnn")) as inner:
        ek.infer_dataset(inner, [x[:2]], tmp_path / "warm", 2)  # first-use imports: not timed
        engine = Limited(inner, limit=64, slow=2, slow_runs=10)  # each batch sleeps 0.05 s
        rows = (x[i : i + 2] for i in range(0, 20, 2))  # one batch a piece: a put each
        s = ek.infer_dataset(engine, rows, tmp_path / "out", 2, prefetch=1)
    assert s.stages.batches == 10 and s.stages.read < s.stages.infer / 2


class Burning(ek.Engine):
    """A real engine that first burns ``burn`` CPU seconds of its caller's thread per call (or,
    with ``sleep``, waits that long without using the CPU)."""

    def __init__(self, inner: ek.Engine, burn: float, sleep: bool = False) -> None:
        super().__init__(inner.inputs, inner.outputs, inner.profiles, inner.manifest)
        self.inner, self.burn, self.sleep = inner, burn, sleep

    def _run(self, feeds):
        if self.sleep:
            time.sleep(self.burn)
        else:
            end = time.thread_time() + self.burn
            while time.thread_time() < end:
                pass
        return self.inner.infer(feeds)


def test_engine_stage_cpu_is_the_streams_threads_cpu_added_up(ekit, tmp_path):
    # Per-stage CPU is how a run shows what the pipeline spends beside the engine: the streams'
    # threads' CPU counts every stream (added, not averaged like their wall-clock times), and
    # time an engine call spends waiting is not CPU.
    x = cnn_rows(40)
    with ek.load(ekit("cnn")) as inner:
        busy = ek.infer_dataset(Burning(inner, 0.01), [x], tmp_path / "busy", 4, streams=2)
        idle = ek.infer_dataset(
            Burning(inner, 0.01, sleep=True), [x], tmp_path / "idle", 4, streams=2
        )
    assert busy.stages.batches == idle.stages.batches == 10
    assert busy.stages.infer_cpu >= 0.1  # 10 calls of 10 ms of CPU, on 2 threads
    assert idle.stages.infer_cpu < 0.05 + busy.stages.infer_cpu - 0.1  # the sleeps: no CPU
    assert busy.to_json()["stages"]["infer_cpu"] == round(busy.stages.infer_cpu, 4)
    assert f"(cpu {busy.stages.infer_cpu:.2f})" in busy.stages.describe()
