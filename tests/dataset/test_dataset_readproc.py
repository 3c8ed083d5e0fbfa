"""The Parquet reader in a process of its own (``infer_dataset(reader="process")``): the same
rows as the thread reader, exactly once across a kill, typed errors, and nothing left behind
(no process, no shared-memory segment) after a job, a failing job or an interrupted one."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dataset_helpers import cnn_rows, tensor_column, write_parquet

import enginekit as ek

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")
pytest.importorskip("cramjam", reason="the page reader decompresses with cramjam")
if not sys.platform.startswith("linux"):
    pytest.skip("the process reader's segments are checked in /dev/shm (Linux)", allow_module_level=True)  # fmt: skip
from enginekit.dataset import readproc
from enginekit.dataset.batches import rebatch
from enginekit.dataset.parquet import ParquetSource
from enginekit.errors import DatasetError, UsageError

ROOT = Path(__file__).resolve().parents[2]
ROWS = 1500


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readproc") / "src"
    x = cnn_rows(ROWS)
    for i, (lo, hi) in enumerate([(0, 400), (400, 401), (401, ROWS)]):
        write_parquet(
            folder / f"part{i}.parquet",
            {"uid": np.arange(lo, hi) * 3, "x": tensor_column(x[lo:hi])},
            row_group_size=150,
        )
    return folder


@pytest.fixture(scope="module")
def cnn(ekit):
    with ek.load(ekit("cnn"), threads=1) as engine:
        yield engine


def _segments(pid: int | None = None) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"ek{pid or os.getpid()}_")]


def _nothing_left() -> None:
    assert not multiprocessing.active_children()
    assert _segments() == []


@pytest.mark.parametrize("start", [0, 96, 448])
def test_process_reader_gives_the_thread_reader_s_batches_from_any_start(cnn, data, start):
    # Same order, same resume skip, same shard marks; inputs viewed in shared memory.
    src = ParquetSource(data, cnn.inputs, None, None, False)
    want = list(rebatch(src.pieces(start, 32), 32, 64, start))
    reader = readproc.ProcessReader(src, start, 32, 64)
    try:
        got = [b for chunk in reader.chunks() for b in chunk]
        assert len(got) == len(want)
        shared = 0
        for g, w in zip(got, want):
            assert (g.shard, g.last, g.piece.rows) == (w.shard, w.last, w.piece.rows)
            assert g.piece.ids["uid"].to_pylist() == w.piece.ids["uid"].to_pylist()
            np.testing.assert_array_equal(g.piece.inputs["x"], w.piece.inputs["x"])
            shared += g.piece.inputs["x"].base is not None and not g.piece.inputs["x"].flags.owndata
        assert shared > len(got) // 2  # most batches are views of a slot, not copies
        del got, g
    finally:
        reader.close()
    _nothing_left()


def test_process_reader_job_output_is_the_thread_reader_s_row_for_row(cnn, data, tmp_path):
    import pyarrow.parquet as pq

    for reader in ("thread", "process"):
        s = ek.infer_dataset(
            cnn, data, tmp_path / reader, batch_size=32, shard_rows=256, streams=2,
            reader=reader, progress=False,
        )  # fmt: skip
        assert s.rows_inferred == ROWS
        assert s.stages.read_cpu > 0
    a, b = pq.read_table(tmp_path / "thread"), pq.read_table(tmp_path / "process")
    assert a.column("uid").to_pylist() == list(range(0, 3 * ROWS, 3))
    assert a.equals(b)
    _nothing_left()


def test_slots_are_reused_only_once_no_batch_views_them(cnn, data):
    # Two slots for ~10 reads: the child must wait for the job to drop each slot's batches;
    # held batches keep their rows while later reads go on.
    src = ParquetSource(data, cnn.inputs, None, None, False)
    want = [b.piece.inputs["x"].copy() for b in rebatch(src.pieces(0, 16), 16, 10**6, 0)]
    reader = readproc.ProcessReader(src, 0, 16, 10**6, slots=2)
    try:
        held, n = [], 0
        for chunk in reader.chunks():
            for b in chunk:
                np.testing.assert_array_equal(b.piece.inputs["x"], want[n])
                n += 1
            held.append(chunk[-1])  # keeps its slot busy for a while
            if len(held) > 1:
                old = held.pop(0)
                np.testing.assert_array_equal(old.piece.inputs["x"], want[n - len(chunk) - 1])
                del old
            del chunk, b
        assert n == len(want)
        del held
    finally:
        reader.close()
    _nothing_left()


def test_a_corrupt_file_s_error_surfaces_typed_and_leaves_nothing(cnn, data, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from enginekit.dataset import pages, parquet

    folder = tmp_path / "src"
    shutil.copytree(data, folder)
    bad = folder / "part2.parquet"
    chunk = pq.ParquetFile(bad).metadata.row_group(3).column(1)
    _, body = pages.struct_at(parquet._map(bad), chunk.data_page_offset)
    raw = bytearray(bad.read_bytes())
    raw[body : body + 8] = b"\xff" * 8  # the page's stream header: not a stream of its size
    bad.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="part2.parquet"):
        ek.infer_dataset(
            cnn, folder, tmp_path / "out", batch_size=32, shard_rows=64, streams=2,
            reader="process", progress=False,
        )  # fmt: skip
    _nothing_left()


class _Interrupting:
    """An engine that raises KeyboardInterrupt on its third call."""

    def __init__(self, engine: ek.Engine) -> None:
        self.engine, self.calls = engine, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def infer(self, feeds):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return self.engine.infer(feeds)


def test_an_interrupted_job_reaps_the_reader_and_unlinks_its_segments(cnn, data, tmp_path):
    from enginekit.engine import Engine

    engine = _Interrupting(cnn)
    engine.__class__ = type("InterruptingEngine", (_Interrupting, Engine), {})
    with pytest.raises(KeyboardInterrupt):
        ek.infer_dataset(
            engine, data, tmp_path / "out", batch_size=16, shard_rows=64, streams=1,
            reader="process", progress=False,
        )  # fmt: skip
    _nothing_left()


CHILD = """
import sys, enginekit as ek
if __name__ == "__main__":
    ek.infer_dataset(sys.argv[1], sys.argv[2], sys.argv[3], batch_size=16, shard_rows=32, streams=2, resume=True, progress=False, reader="process")
"""


@pytest.mark.slow
def test_killed_then_resumed_with_the_process_reader_is_exactly_once(ekit, data, tmp_path):
    import json

    import pyarrow.parquet as pq

    from enginekit.dataset.ledger import NAME

    artifact, out = ekit("cnn"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(artifact), str(data), str(out)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if len(json.loads((out / NAME).read_text())["shards"]) >= 5:
                proc.send_signal(signal.SIGKILL)
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.0005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job ended before the kill point"
    committed = len(json.loads((out / NAME).read_text())["shards"])
    s = ek.infer_dataset(
        artifact, data, out, batch_size=16, shard_rows=32, streams=2, resume=True,
        progress=False, reader="process",
    )  # fmt: skip
    assert s.shards_skipped == committed and s.rows_skipped + s.rows_inferred == ROWS
    ref = ek.infer_dataset(artifact, data, tmp_path / "ref", batch_size=16, shard_rows=32)
    assert ref.rows == ROWS
    assert pq.read_table(out).equals(pq.read_table(tmp_path / "ref"))
    # The killed job's reader and segments went with it (the reader sees its pipe close,
    # the resource tracker unlinks what it registered).
    for _ in range(100):
        if not _segments(proc.pid):
            break
        time.sleep(0.05)
    assert _segments(proc.pid) == []
    _nothing_left()


def test_other_sources_read_in_a_thread_and_a_bad_reader_is_refused(cnn, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(40))
    s = ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "out", 8, reader="process")
    assert s.rows == 40
    with pytest.raises(UsageError, match="reader"):
        ek.infer_dataset(cnn, tmp_path / "x.npy", tmp_path / "o2", 8, reader="proc")
    _nothing_left()
