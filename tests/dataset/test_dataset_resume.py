"""Exactly once across crashes: a run killed with SIGKILL at several points, then resumed, gives
output identical to an uninterrupted run, redoing at most the one shard it was writing; a
changed model, source or setting refuses to resume and says which."""

from __future__ import annotations

import json
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
from enginekit.dataset.ledger import NAME
from enginekit.errors import DatasetError

ROOT = Path(__file__).resolve().parents[2]
ROWS, SHARD = 3000, 16

CHILD = """
import sys, enginekit as ek
ek.infer_dataset(sys.argv[1], sys.argv[2], sys.argv[3], batch_size="auto", shard_rows=int(sys.argv[4]), resume=True, progress=False)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    x = cnn_rows(ROWS)
    for i in range(3):
        lo, hi = i * ROWS // 3, (i + 1) * ROWS // 3
        write_parquet(
            folder / "src" / f"part{i}.parquet",
            {"uid": np.arange(lo, hi) * 7, "x": tensor_column(x[lo:hi])},
            row_group_size=100,
        )
    return folder / "src"


def _ledger(out: Path) -> dict | None:
    try:
        return json.loads((out / NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _run_and_kill(artifact: Path, src: Path, out: Path, when) -> dict | None:
    """Start the job in a subprocess and SIGKILL it as soon as ``when(out)`` holds."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(artifact), str(src), str(out), str(SHARD)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if out.is_dir() and when(out):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.0005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job ended before the kill point"
    return _ledger(out)


def _committed(out: Path) -> int:
    led = _ledger(out)
    return len(led["shards"]) if led else 0


KILL_POINTS = {
    "before any shard": lambda out: (out / NAME).exists(),
    "while a shard is written": lambda out: any(p.name.startswith(".part-") for p in out.iterdir()),
    "file in place, not yet committed": lambda out: len(list(out.glob("part-*"))) > _committed(out),
    "after many shards": lambda out: _committed(out) >= 60,
}


@pytest.mark.slow
def test_kill_at_several_points_then_resume_gives_identical_output(ekit, data, tmp_path):
    import pyarrow.parquet as pq

    artifact = ekit("cnn")
    total = -(-ROWS // SHARD)
    reference = None
    for i, (point, when) in enumerate(KILL_POINTS.items()):
        out = tmp_path / f"out{i}"
        _run_and_kill(artifact, data, out, when)
        led = _ledger(out)
        committed = len(led["shards"]) if led else 0
        on_disk = {p.name for p in out.glob("part-*")} if out.exists() else set()
        listed = {s["file"] for s in led["shards"]} if led else set()
        # At most the one shard being committed is on disk without being in the ledger.
        assert listed <= on_disk and len(on_disk - listed) <= 1, point
        s = ek.infer_dataset(artifact, data, out, resume=True, shard_rows=SHARD, progress=False)
        assert (s.shards_skipped, s.shards_written, s.shards) == (
            committed,
            total - committed,
            total,
        ), point
        assert s.rows_skipped == committed * SHARD and s.rows_inferred == ROWS - committed * SHARD
        if reference is None:  # one uninterrupted run at the batch size the ledger chose
            ek.infer_dataset(
                artifact, data, tmp_path / "ref", batch_size=s.batch_size, shard_rows=SHARD
            )
            reference = pq.read_table(tmp_path / "ref")
        result = pq.read_table(out)
        if s.batch_size != _ledger(tmp_path / "ref")["batch_size"]:
            ek.infer_dataset(
                artifact,
                data,
                tmp_path / "ref",
                batch_size=s.batch_size,
                shard_rows=SHARD,
                overwrite=True,
            )
            reference = pq.read_table(tmp_path / "ref")
        assert result.column("uid").to_pylist() == list(range(0, 7 * ROWS, 7)), point
        assert result.equals(reference), point
        assert not [p for p in out.iterdir() if p.name.startswith(".")], point


def test_changed_model_source_or_settings_refuse_to_resume(ekit, onnx_model, tmp_path):
    np.save(tmp_path / "x.npy", cnn_rows(20))
    artifact = ekit("cnn")
    ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "out", batch_size=4, shard_rows=8)
    s = ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "out", resume=True)
    assert (s.shards_skipped, s.shards_written, s.rows_inferred) == (3, 0, 0)
    other = ek.build(
        onnx_model("cnn"), shapes={"x": [(1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16)]}
    )
    with other, pytest.raises(DatasetError, match=r"the model changed.*--overwrite"):
        ek.infer_dataset(other, tmp_path / "x.npy", tmp_path / "out", resume=True)
    with pytest.raises(DatasetError, match="setting 'format'"):
        ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "out", resume=True, format="npz")
    with pytest.raises(DatasetError, match="batch size 2"):
        ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "out", resume=True, batch_size=2)
    time.sleep(0.01)
    np.save(tmp_path / "x.npy", cnn_rows(20, seed=1))
    with pytest.raises(DatasetError, match=r"the source changed.*modified"):
        ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "out", resume=True)
    with pytest.raises(DatasetError, match="no ledger"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "f").write_text("x")
        ek.infer_dataset(artifact, tmp_path / "x.npy", tmp_path / "other", resume=True)
