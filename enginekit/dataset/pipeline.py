"""The pipeline of a local dataset job: reader thread -> engine -> writer thread, with stage timers.

Three stages overlap, joined by bounded queues: a reader thread (reading, decoding — images in
a thread pool or worker processes — and cutting rows into batches that never cross a shard
boundary), the engine on the calling thread, and a writer thread that gathers a shard's
outputs, writes the shard atomically and commits it to the ledger. The queues bound memory; the
engine only waits when reading is slower than inference.

Each stage times itself (:class:`StageTimes`): the seconds it spent working, the CPU its thread
used, and how long the engine waited on either queue — which names the stage that limited the
run (``bottleneck``). On a machine with few cores the reader and writer take CPU from the
engine even when the engine never waits: ``read_cpu`` and ``write_cpu`` show how much.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset import ledger as ledger_mod
from enginekit.dataset.autobatch import is_out_of_memory
from enginekit.dataset.batches import Batch, concat_ids, rebatch
from enginekit.dataset.progress import Progress
from enginekit.dataset.sinks import shard_name, write_shard
from enginekit.dataset.sources import Piece, Source
from enginekit.engine import Engine
from enginekit.errors import DatasetError

_END = object()
#: Niceness added to the reader's and writer's threads (Linux; 0: none). A positive value lets
#: the engine's threads run first and I/O fill the gaps they leave; benchmarks/dataset.py
#: measures both (see docs/batch-inference.md, "Where the time goes").
IO_NICE = 0
#: Engine calls queued per stream beyond the one running (streams > 1): a stream that finishes
#: a call starts the next queued one at once, instead of waiting for the dispatching thread
#: to wake, hand the result on and submit another.
QUEUED = 1
#: The engine waiting on a queue for more than this share of its loop names that stage the
#: bottleneck; below it, the engine itself limited the run (reading and writing were hidden).
WAIT_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Where a run's time went, per stage (seconds).

    ``read``/``infer``/``write``: time each stage spent working (wall clock inside its thread;
    on Ray, ``infer`` is the driver waiting for Ray's results: reading and the engine both
    run there). ``read_cpu``/``write_cpu``: CPU the reader's and writer's threads used
    (decoding inside pyarrow's or Pillow's own threads is not counted). ``first_batch``: until
    the engine had its first batch (start-up: opening files, Ray's actors). ``wait_input``,
    ``wait_output``: the engine idle afterwards, waiting for a batch or for room in the
    writer's queue.
    """

    read: float = 0.0
    read_cpu: float = 0.0
    infer: float = 0.0
    write: float = 0.0
    write_cpu: float = 0.0
    first_batch: float = 0.0
    wait_input: float = 0.0
    wait_output: float = 0.0
    batches: int = 0
    remote: bool = False  # the engine ran on Ray

    @property
    def bottleneck(self) -> str:
        """The stage that limited the run: ``read``, ``infer``, ``write`` (or ``ray``)."""
        loop = self.infer + self.wait_input + self.wait_output
        if self.remote:
            return "write" if self.wait_output > WAIT_SHARE * loop else "ray"
        if loop <= 0:
            return "infer"
        if self.wait_input >= WAIT_SHARE * loop and self.wait_input >= self.wait_output:
            return "read"
        if self.wait_output >= WAIT_SHARE * loop:
            return "write"
        return "infer"

    def __add__(self, other: StageTimes) -> StageTimes:
        """Field by field: each stage's thread keeps its own times; the run's are their sum."""
        return StageTimes(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
                if f.name != "remote"
            },
            remote=self.remote or other.remote,
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in dataclasses.asdict(self).items()
        }
        out["bottleneck"] = self.bottleneck
        return out

    def describe(self) -> str:
        """One line for the CLI summary."""
        if self.remote:
            work = f"Ray (reading + engine) {self.infer:.2f} s, first result after {self.first_batch:.2f} s"
        else:
            work = f"read {self.read:.2f} s (cpu {self.read_cpu:.2f}), infer {self.infer:.2f} s"
        return (
            f"stages: {work}, write {self.write:.2f} s (cpu {self.write_cpu:.2f}); engine waited "
            f"{self.wait_input:.2f} s for input, {self.wait_output:.2f} s for the writer; "
            f"bottleneck: {self.bottleneck}"
        )


@dataclasses.dataclass
class State:
    """Shared by the threads of one run: the first error stops all of them."""

    oom: int = 0
    error: BaseException | None = None
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Each stage's times, added by its thread when it ends (reader, engine loop, writer).
    times: list[StageTimes] = dataclasses.field(default_factory=list)

    def stage_times(self, remote: bool = False) -> StageTimes:
        """The run's times: the sum of what each stage recorded."""
        return sum(self.times, StageTimes(remote=remote))


def _lower_priority(nice: int) -> None:
    """Lower this thread's CPU priority by ``nice`` (Linux: niceness is per thread)."""
    import os

    if nice > 0 and hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
            pass  # not permitted: run at the usual priority


def _put(q: queue.Queue, item: Any, state: State) -> bool:
    """Put unless the job is stopping; False when it is."""
    while not state.stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue, state: State) -> Any:
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if state.stop.is_set():
                return _END


def _infer(engine: Engine, inputs: dict[str, np.ndarray], state: State) -> dict[str, np.ndarray]:
    """Run one batch; on an out-of-memory error, run it as two halves (recorded)."""
    try:
        return engine.infer(inputs)
    except Exception as exc:
        n = next(iter(inputs.values())).shape[0]
        if not is_out_of_memory(exc) or n < 2:
            raise
        state.oom += 1
        half = n // 2
        a = _infer(engine, {k: v[:half] for k, v in inputs.items()}, state)
        b = _infer(engine, {k: v[half:] for k, v in inputs.items()}, state)
        return {k: np.concatenate([a[k], b[k]]) for k in a}


def run_local(
    engine: Engine, src: Source, led: ledger_mod.Ledger, out: Path, fmt: str, tensor_format: str,
    size: int, shard_rows: int, start: int, prefetch: int, bar: Progress, state: State,
    streams: int = 1, total: int | None = None,
) -> int:  # fmt: skip
    """Rows from ``start`` through the engine into committed shards; returns the rows inferred.

    ``total``: the source's rows, when known: the commit that reaches it also marks the ledger
    complete (one save, not two, after the last batch).

    ``streams`` > 1 keeps that many engine calls in flight on worker threads (the engine is
    thread-safe); results still reach the writer in the source's order, so shards, the ledger
    and resume are exactly as with one stream.
    """
    inbox: queue.Queue = queue.Queue(prefetch)
    # The writer's items hold outputs and ids, not the inputs (dropped below). Room for a whole
    # shard's batches: while the writer writes and fsyncs one shard, the engine goes on with
    # the next instead of blocking (the writer holds a shard's outputs until it is written
    # anyway, so this at most doubles what it holds).
    outbox: queue.Queue = queue.Queue(max(4 * prefetch, -(-shard_rows // size) + prefetch))

    def read() -> None:
        _lower_priority(IO_NICE)
        cpu = time.thread_time()
        busy = 0.0
        try:
            batches = rebatch(src.pieces(start, size), size, shard_rows, start)
            while True:
                t = time.perf_counter()
                batch = next(batches, _END)
                busy += time.perf_counter() - t
                if batch is _END or not _put(inbox, batch, state):
                    break
        except BaseException as exc:
            state.error = state.error or exc
            state.stop.set()
        state.times.append(StageTimes(read=busy, read_cpu=time.thread_time() - cpu))
        _put(inbox, _END, state)

    began = time.perf_counter()
    reader = threading.Thread(target=read, name="enginekit-read", daemon=True)
    reader.start()
    writer = start_writer(outbox, led, out, fmt, tensor_format, bar, state, total)
    rows = batches = 0
    first = infer = wait_input = wait_output = 0.0
    pool = (
        concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix="enginekit-stream")
        if streams > 1
        else None
    )
    # Calls in flight, oldest first: (batch without its inputs, its outputs' future).
    flight: collections.deque[tuple[Batch, Any]] = collections.deque()
    depth = streams if pool is None else streams * (1 + QUEUED)
    try:
        ended = False
        while not ended or flight:
            t0 = time.perf_counter()
            batch = _END
            if not ended and len(flight) < depth:
                batch = _get(inbox, state)
                t1 = time.perf_counter()
                if batches:
                    wait_input += t1 - t0
                else:
                    first = t1 - began
                if batch is _END:
                    ended = True
                else:
                    batches += 1
                    rows += batch.piece.rows
                    piece = batch.piece
                    done = Batch(batch.shard, batch.last, Piece(piece.ids, {}, piece.rows))
                    if pool is None:
                        outputs = _infer(engine, piece.inputs, state)
                        flight.append((done, outputs))
                    else:
                        flight.append((done, pool.submit(_infer, engine, piece.inputs, state)))
                    t0 = time.perf_counter()
                    infer += t0 - t1 if pool is None else 0.0
                if len(flight) < depth and not ended:
                    continue  # fill every stream before waiting on the oldest
            if not flight:
                continue
            done, outputs = flight.popleft()
            if pool is not None:
                outputs = outputs.result()
            t2 = time.perf_counter()
            infer += t2 - t0 if pool is not None else 0.0
            if not _put(outbox, (done, outputs), state):
                break
            wait_output += time.perf_counter() - t2
    except BaseException as exc:
        state.error = state.error or exc
        state.stop.set()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    state.times.append(
        StageTimes(
            infer=infer,
            first_batch=first,
            wait_input=wait_input,
            wait_output=wait_output,
            batches=batches,
        )
    )
    _put(outbox, _END, state)
    writer.join()
    state.stop.set()
    reader.join()
    if state.error is not None:
        raise state.error
    return rows


def write_all(
    results: Iterator[tuple[Batch, dict[str, np.ndarray]]], led: ledger_mod.Ledger, out: Path,
    fmt: str, tensor_format: str, bar: Progress, state: State, prefetch: int,
    total: int | None = None,
) -> int:  # fmt: skip
    """The writer for results computed elsewhere (Ray): same shards, same ledger."""
    outbox: queue.Queue = queue.Queue(prefetch)
    rows = batches = 0
    first = waited = wait_output = 0.0
    began = time.perf_counter()
    writer = start_writer(outbox, led, out, fmt, tensor_format, bar, state, total)
    try:
        t0 = time.perf_counter()
        for item in results:
            t1 = time.perf_counter()
            if batches:
                waited += t1 - t0
            else:
                first = t1 - began
            batches += 1
            rows += item[0].piece.rows
            if not _put(outbox, item, state):
                break
            t0 = time.perf_counter()
            wait_output += t0 - t1
    except BaseException as exc:
        state.error = state.error or exc
        state.stop.set()
    state.times.append(
        StageTimes(
            infer=waited, first_batch=first, wait_output=wait_output, batches=batches, remote=True
        )
    )
    _put(outbox, _END, state)
    writer.join()
    if state.error is not None:
        raise state.error
    return rows


def start_writer(
    outbox: queue.Queue, led: ledger_mod.Ledger, out: Path, fmt: str, tensor_format: str,
    bar: Progress, state: State, total: int | None = None,
) -> threading.Thread:  # fmt: skip
    """The writer thread: shards from ``outbox`` until the end mark; an error stops the run
    (``total``: the source's rows, when known; see :func:`run_local`)."""

    def write() -> None:
        _lower_priority(IO_NICE)
        cpu = time.thread_time()
        busy = [0.0]
        try:
            _write_loop(outbox, led, out, fmt, tensor_format, bar, state, busy, total)
        except BaseException as exc:
            state.error = state.error or exc
            state.stop.set()
        state.times.append(StageTimes(write=busy[0], write_cpu=time.thread_time() - cpu))

    writer = threading.Thread(target=write, name="enginekit-write", daemon=True)
    writer.start()
    return writer


def _write_loop(
    outbox: queue.Queue, led: ledger_mod.Ledger, out: Path, fmt: str, tensor_format: str,
    bar: Progress, state: State, busy: list[float], total: int | None = None,
) -> None:  # fmt: skip
    """Write shards until the end mark, adding the seconds spent writing to ``busy[0]``."""
    # Only the ids and outputs of a shard's batches are kept until it is written: holding the
    # inputs too would keep a whole shard of input rows alive (and copy them when joined).
    parts: list[tuple[dict[str, Any], int, dict[str, np.ndarray]]] = []
    shard = len(led.shards)
    while True:
        item = _get(outbox, state)
        if item is _END:
            break
        t = time.perf_counter()
        batch, outputs = item
        if batch.shard != shard:
            raise DatasetError(f"internal: batch of shard {batch.shard} while writing {shard}")
        parts.append((batch.piece.ids, batch.piece.rows, outputs))
        bar.advance(batch.piece.rows)
        if batch.last:
            _commit(parts, shard, led, out, fmt, tensor_format, total)
            parts, shard = [], shard + 1
        busy[0] += time.perf_counter() - t
    if parts and not state.stop.is_set():
        t = time.perf_counter()
        _commit(parts, shard, led, out, fmt, tensor_format, total)
        busy[0] += time.perf_counter() - t


def _commit(
    parts: list[tuple[dict[str, Any], int, dict[str, np.ndarray]]], shard: int,
    led: ledger_mod.Ledger, out: Path, fmt: str, tensor_format: str, total: int | None = None,
) -> None:  # fmt: skip
    # One concatenation per shard, not per batch: ids as Arrow arrays, outputs as numpy.
    ids = concat_ids([i for i, _, _ in parts]) if len(parts) > 1 else parts[0][0]
    outputs = {
        k: np.concatenate([o[k] for _, _, o in parts]) if len(parts) > 1 else parts[0][2][k]
        for k in parts[0][2]
    }
    name = shard_name(shard, fmt)
    write_shard(out / name, ids, outputs, fmt, tensor_format)
    rows = sum(n for _, n, _ in parts)
    led.commit(shard, name, rows, last=total is not None and led.committed_rows() + rows >= total)
