"""The pipeline of a local dataset job: reader thread -> engine -> writer thread, with stage timers.

Three stages overlap, joined by bounded queues: a reader thread (reading, decoding — images in
a thread pool or worker processes — and cutting rows into batches that never cross a shard
boundary), the engine (on the calling thread, or one thread per stream, each taking the next
batch itself), and a writer thread that writes each shard atomically and commits it to the
ledger. Hand-offs are per read and per shard, not per batch (each wakes a thread that takes a
core from the engine). The queues bound memory; the engine only waits when reading is slower
than inference.

Each stage times itself (:class:`StageTimes`): the seconds it spent working, the CPU its thread
used, and how long the engine waited on either queue — which names the stage that limited the
run (``bottleneck``). On a machine with few cores the reader and writer take CPU from the
engine even when the engine never waits: ``read_cpu`` and ``write_cpu`` show how much.
"""

from __future__ import annotations

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
from enginekit.dataset.batches import Batch, BatchQueue, concat_ids, rebatch
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
#: The engine waiting on a queue for more than this share of its loop names that stage the
#: bottleneck; below it, the engine itself limited the run (reading and writing were hidden).
WAIT_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Where a run's time went, per stage (seconds).

    ``read``/``infer``/``write``: time each stage spent working (wall clock inside its thread;
    on Ray, ``infer`` is the driver waiting for Ray's results: reading and the engine both
    run there). ``read_cpu``/``write_cpu``: CPU the reader's and writer's threads used
    (decoding inside pyarrow's or Pillow's own threads is not counted). ``infer_cpu``: CPU
    the threads that call the engine used, all streams together: the whole engine when each
    call runs on its caller's thread (one thread per call, as ``streams`` > 1 loads it), not
    the worker threads of an engine's own pool; with ``read_cpu`` and ``write_cpu``, the CPU
    the pipeline spends beside the engine. ``first_batch``: until
    the engine had its first batch (start-up: opening files, Ray's actors). ``wait_input``,
    ``wait_output``: the engine idle afterwards, waiting for a batch or for room in the
    writer's queue.
    """

    read: float = 0.0
    read_cpu: float = 0.0
    infer: float = 0.0
    infer_cpu: float = 0.0
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
            work = (
                f"read {self.read:.2f} s (cpu {self.read_cpu:.2f}), infer {self.infer:.2f} s "
                f"(cpu {self.infer_cpu:.2f})"
            )
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
    streams: int = 1, total: int | None = None, save_first: bool = False,
) -> int:  # fmt: skip
    """Rows from ``start`` through the engine into committed shards; returns the rows inferred.

    ``total``: the source's rows, when known: the commit that reaches it also marks the ledger
    complete (one save, not two, after the last batch). ``save_first``: the writer saves the
    ledger before its first shard (see :func:`start_writer`).

    ``streams`` > 1 runs that many engine calls at once, each stream on its own thread taking
    the next batch itself (the engine is thread-safe); results still reach the writer in the
    source's order, so shards, the ledger and resume are exactly as with one stream.

    Hand-offs are per read and per shard, not per batch: the reader queues all the batches one
    read made at once, and the writer is handed a whole shard. On a machine with few cores
    every hand-off wakes a thread that takes a core from the engine mid-call (per batch, the
    reader, the dispatching thread and the writer woke ~1,700 times per 40k rows of the
    demo CNN and preempted the engine's threads ~900 times; see docs/batch-inference.md).
    """
    inbox = BatchQueue(prefetch)
    # Whole shards: the one being written and one more, so that the engine goes on with the
    # next shard while the writer writes and fsyncs one (the engine holds at most one more).
    outbox: queue.Queue = queue.Queue(1)

    def read() -> None:
        _lower_priority(IO_NICE)
        cpu = time.thread_time()
        busy = 0.0
        chunk: list[Batch] = []

        def pulled(pieces: Iterator[Piece]) -> Iterator[Piece]:
            # Before the next piece is read, hand on the batches the last one made: a slow
            # source's batch is never held back waiting for more. (Waiting for room in the
            # inbox is not reading: taken out of ``busy``.)
            nonlocal busy
            for piece in pieces:
                yield piece
                t = time.perf_counter()
                if chunk and not inbox.put(chunk, state.stop):
                    raise _Stopped
                busy -= time.perf_counter() - t
                chunk.clear()

        try:
            batches = rebatch(pulled(src.pieces(start, size)), size, shard_rows, start)
            while True:
                t = time.perf_counter()
                batch = next(batches, None)
                busy += time.perf_counter() - t
                if batch is None:
                    break
                chunk.append(batch)
            if chunk:
                inbox.put(chunk, state.stop)
        except _Stopped:
            pass
        except BaseException as exc:
            state.error = state.error or exc
            state.stop.set()
        state.times.append(StageTimes(read=busy, read_cpu=time.thread_time() - cpu))
        inbox.close()

    began = time.perf_counter()
    reader = threading.Thread(target=read, name="enginekit-read", daemon=True)
    reader.start()
    writer = start_writer(outbox, led, out, fmt, tensor_format, bar, state, total, save_first)
    flow = _Flow(inbox, outbox, state, bar, began)
    workers = [
        threading.Thread(target=flow.work, args=(engine,), name=f"enginekit-stream-{i}")
        for i in range(streams if streams > 1 else 0)
    ]
    try:
        if workers:
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            flow.work(engine)  # one stream: the engine runs on the calling thread
        flow.finish()
    except BaseException as exc:
        state.error = state.error or exc
        state.stop.set()
    state.times.append(flow.times(max(1, len(workers))))
    _put(outbox, _END, state)
    writer.join()
    state.stop.set()
    reader.join()
    if state.error is not None:
        raise state.error
    return flow.rows


class _Stopped(Exception):
    """The job is stopping: the reader ends without handing on more."""


class _Flow:
    """The engine stage: each stream takes the next batch in the source's order, runs it, and
    gathers its outputs in order into shards for the writer (one hand-off per shard)."""

    def __init__(
        self, inbox: BatchQueue, outbox: queue.Queue, state: State, bar: Progress, began: float
    ) -> None:
        self.inbox, self.outbox, self.state, self.bar, self.began = inbox, outbox, state, bar, began
        self.gather_lock = threading.Lock()  # outputs back in order, then to the writer
        self.done: dict[int, tuple[Batch, dict[str, np.ndarray]]] = {}
        self.next = 0  # the sequence number the shard in progress needs next
        self.shard: list[tuple[Batch, dict[str, np.ndarray]]] = []
        self.rows = 0
        self.first: float | None = None
        #: Each stream's infer, waits for input and output (seconds), and its thread's CPU.
        self.stats: list[tuple[float, float, float, float]] = []

    def _take(self) -> tuple[int, Batch] | None:
        got = self.inbox.get(self.state.stop)
        if got is not None and self.first is None:
            self.first = time.perf_counter() - self.began
        return got

    def work(self, engine: Engine) -> None:
        """One stream: batches until the source ends or the job stops."""
        infer = wait_input = wait_output = 0.0
        cpu = time.thread_time()
        started = False
        try:
            while not self.state.stop.is_set():
                t0 = time.perf_counter()
                got = self._take()
                t1 = time.perf_counter()
                wait_input += t1 - t0 if started else 0.0
                started = True
                if got is None:
                    break
                seq, batch = got
                piece = batch.piece
                outputs = _infer(engine, piece.inputs, self.state)
                t2 = time.perf_counter()
                infer += t2 - t1
                # Only the ids and outputs are kept until the shard is written: holding the
                # inputs too would keep a whole shard of input rows alive.
                done = Batch(batch.shard, batch.last, Piece(piece.ids, {}, piece.rows))
                del got, batch, piece
                if not self._gather(seq, done, outputs):
                    break
                wait_output += time.perf_counter() - t2
        except BaseException as exc:
            self.state.error = self.state.error or exc
            self.state.stop.set()
        cpu = time.thread_time() - cpu
        with self.gather_lock:
            self.stats.append((infer, wait_input, wait_output, cpu))

    def _gather(self, seq: int, done: Batch, outputs: dict[str, np.ndarray]) -> bool:
        """Outputs back in the source's order; a shard's last batch hands the shard on (the
        put may wait for the writer: counted as the engine waiting on output)."""
        with self.gather_lock:
            self.done[seq] = (done, outputs)
            while self.next in self.done:
                item = self.done.pop(self.next)
                self.next += 1
                self.rows += item[0].piece.rows
                self.bar.advance(item[0].piece.rows)
                self.shard.append(item)
                if item[0].last:
                    shard, self.shard = self.shard, []
                    if not _put(self.outbox, shard, self.state):
                        return False
        return True

    def finish(self) -> None:
        """The source ended: a last shard that ended without its ``last`` mark goes too."""
        if self.shard and not self.state.stop.is_set():
            _put(self.outbox, self.shard, self.state)
            self.shard = []

    def times(self, streams: int) -> StageTimes:
        """The engine stage's times: each stream's, averaged (wall-clock, like one stream's);
        the CPU of all streams' threads, added up."""
        stats = self.stats or [(0.0, 0.0, 0.0, 0.0)]
        infer, wait_input, wait_output = (sum(x) / streams for x in list(zip(*stats))[:3])
        return StageTimes(
            infer=infer,
            infer_cpu=sum(s[3] for s in stats),
            first_batch=self.first or 0.0,
            wait_input=wait_input,
            wait_output=wait_output,
            batches=self.inbox.taken,
        )


def write_all(
    results: Iterator[tuple[Batch, dict[str, np.ndarray]]], led: ledger_mod.Ledger, out: Path,
    fmt: str, tensor_format: str, bar: Progress, state: State, prefetch: int,
    total: int | None = None, save_first: bool = False,
) -> int:  # fmt: skip
    """The writer for results computed elsewhere (Ray): same shards, same ledger."""
    outbox: queue.Queue = queue.Queue(1)  # whole shards, as in run_local
    rows = batches = 0
    first = waited = wait_output = 0.0
    began = time.perf_counter()
    writer = start_writer(outbox, led, out, fmt, tensor_format, bar, state, total, save_first)
    shard: list[tuple[Batch, dict[str, np.ndarray]]] = []
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
            bar.advance(item[0].piece.rows)
            shard.append(item)
            if item[0].last:
                shard, full = [], shard
                if not _put(outbox, full, state):
                    break
            t0 = time.perf_counter()
            wait_output += t0 - t1
        if shard and not state.stop.is_set():
            _put(outbox, shard, state)
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
    bar: Progress, state: State, total: int | None = None, save_first: bool = False,
) -> threading.Thread:  # fmt: skip
    """The writer thread: shards from ``outbox`` until the end mark; an error stops the run
    (``total``: the source's rows, when known; see :func:`run_local`).

    ``save_first``: save the ledger (a new one, or how the engine runs changed) before the
    first shard, here rather than before the job starts: its fsync (4-9 ms measured) then
    overlaps the first read instead of delaying the engine's first batch. Exactly-once holds
    as before: no shard file is written before the ledger is on disk, and a crash before then
    leaves no shard (an empty folder starts afresh; a resumed run's ledger is unchanged)."""

    def write() -> None:
        _lower_priority(IO_NICE)
        cpu = time.thread_time()
        busy = [0.0]
        try:
            if save_first:
                t = time.perf_counter()
                led.save()
                busy[0] += time.perf_counter() - t
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
    """Write shards until the end mark, adding the seconds spent writing to ``busy[0]``. Each
    item is one shard's batches, without their inputs, with their outputs."""
    shard = len(led.shards)
    while True:
        item = _get(outbox, state)
        if item is _END:
            break
        t = time.perf_counter()
        for batch, _outputs in item:
            if batch.shard != shard:
                raise DatasetError(f"internal: batch of shard {batch.shard} while writing {shard}")
        parts = [(b.piece.ids, b.piece.rows, o) for b, o in item]
        _commit(parts, shard, led, out, fmt, tensor_format, total)
        shard += 1
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
