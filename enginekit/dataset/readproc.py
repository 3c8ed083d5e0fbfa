"""A Parquet job's reader in a process of its own, its batches handed over in shared memory.

Why: in a local job the reader thread's Python (the page parsing) and cramjam's decompression
hold the engine process's GIL; the engine streams then sleep on it between calls (82-91 times
each per 40k-row job of the benchmark, see docs/batch-inference.md, round 16). Here the
reader runs in a child process (forked from a forkserver that has the reader's modules
loaded, so a job starts it in milliseconds): it reads the pieces the job asks for — same
order, same resume skip — and the page reader decodes each read's tensor columns straight
into a shared-memory slot. Only ``(slot, offset, shape)``, the rows and the id columns cross
the pipe; the streams infer on numpy views of the slots. A slot goes back to the child once
no batch views it (a finalizer on the views' base array) and the child itself holds no view of
it. The ledger and the writer stay in the job's process.

Errors in the child reach the job as the same typed errors (pickled); the child is always
ended and reaped, and every segment unlinked, when the job ends, fails or is interrupted.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from enginekit.dataset.batches import Batch, concat_ids, rebatch
from enginekit.dataset.parquet import HEAD_BYTES, TAIL_BYTES
from enginekit.dataset.sources import READ_BYTES, Piece, Source
from enginekit.errors import DatasetError

#: Shared-memory read slots per tensor input: reads queued, in the engine and being decoded
#: (the thread reader's pool had at most 5 in use in a 2-stream job of 8 MiB reads).
SLOTS = 6
#: The least bytes of a slot: a whole read of the page reader's, with its scratch.
MIN_SLOT_BYTES = READ_BYTES + HEAD_BYTES + TAIL_BYTES
#: Imported lazily by the reader, preloaded in the forkserver.
PRELOAD = ("pyarrow", "pyarrow.parquet", "cramjam", "enginekit.dataset.pages")
_context: Any = None
_context_lock = threading.Lock()


def _ctx() -> Any:
    """The forkserver context, with this module preloaded in the server (one per process)."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            # What the reader imports (pyarrow's alone is ~0.2 CPU-s): in the server, once,
            # not in every job's child.
            ctx.set_forkserver_preload(["enginekit.dataset.readproc", *PRELOAD])
            _context = ctx
        return _context


def usable(src: Source) -> bool:
    """Whether ``src`` can be read in a process: a Parquet source with the page reader on."""
    from enginekit.dataset.parquet import ParquetSource

    return isinstance(src, ParquetSource) and src.fast and sys.platform.startswith("linux")


# -- the child --------------------------------------------------------------------------------


class _ShmPool:
    """The child's read buffers: shared-memory slots, reused once the job has released every
    batch that views one and this process holds no view of it either."""

    def __init__(self, prefix: str, inbox: Connection, slots: int) -> None:
        self.prefix, self.inbox, self.slots = prefix, inbox, slots
        self.count = 0
        #: key -> [name, segment, base array, messages not yet released]
        self.kept: dict[str, list[list[Any]]] = {}
        self.by_name: dict[str, list[Any]] = {}

    def drain(self, block: bool = False) -> None:
        """Take the job's releases (``block``: wait for at least one)."""
        while block or self.inbox.poll():
            msg = self.inbox.recv()
            block = False
            if msg[0] == "stop":
                raise SystemExit(0)
            self.by_name[msg[1]][3] -= 1

    def get(self, key: str, count: int, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        kept = self.kept.setdefault(key, [])
        while True:
            self.drain()
            for slot in kept:
                # 2: the slot's reference and getrefcount's argument; more: a view in here.
                if slot[3] == 0 and sys.getrefcount(slot[2]) == 2:
                    if slot[1].size >= nbytes:
                        return slot[2][:nbytes].view(dtype)
                    kept.remove(slot)  # too small: a larger one in its place
                    del self.by_name[slot[0]]
                    slot[2] = None
                    slot[1].close()
                    slot[1].unlink()
                    break
            if len(kept) < self.slots:
                name = f"{self.prefix}{self.count}"
                self.count += 1
                # A whole read's size at least: the first reads, one batch each, would
                # otherwise leave slots too small for the rest (a new segment is new memory,
                # zeroed page by page as it is first written).
                shm = SharedMemory(name, create=True, size=max(nbytes, MIN_SLOT_BYTES))
                slot = [name, shm, np.frombuffer(shm.buf, np.uint8), 0]
                kept.append(slot)
                self.by_name[name] = slot
                continue
            self.drain(block=True)

    def where(self, a: np.ndarray) -> tuple[str, int] | None:
        """The slot ``a`` lies in and its byte offset there, or None (not shared memory)."""
        addr = a.__array_interface__["data"][0]
        for slot in self.by_name.values():
            start = slot[2].__array_interface__["data"][0]
            if start <= addr < start + slot[2].nbytes:
                return slot[0], addr - start
        return None


def _encode(batches: list[Batch], pool: _ShmPool) -> list[Any]:
    out = []
    used: set[str] = set()  # one use per message and slot: the job releases each once
    for b in batches:
        inputs: dict[str, Any] = {}
        for k, a in b.piece.inputs.items():
            at = pool.where(a) if a.flags.c_contiguous else None
            if at is None:
                inputs[k] = ("array", np.ascontiguousarray(a))
            else:
                used.add(at[0])
                inputs[k] = ("shm", at[0], at[1], a.shape, a.dtype.str)
        # Compact copies: a pickled Arrow slice carries its whole buffer.
        ids = concat_ids([b.piece.ids])
        out.append((b.shard, b.last, b.piece.rows, ids, inputs))
    for name in used:
        pool.by_name[name][3] += 1
    return out


def _child(src: Source, start: int, size: int, shard_rows: int, prefix: str, slots: int,
           outbox: Connection, inbox: Connection) -> None:  # fmt: skip
    """The reader process: reads, cuts batches, sends each read's batches as one message."""
    pool = _ShmPool(prefix, inbox, slots)
    src._buffers = pool  # type: ignore[attr-defined]
    cpu = time.process_time()
    busy = 0.0
    chunk: list[Batch] = []

    def pulled(pieces: Iterator[Piece]) -> Iterator[Piece]:
        nonlocal busy
        for piece in pieces:
            yield piece
            if chunk:
                outbox.send(("batches", _encode(chunk, pool)))
                chunk.clear()

    try:
        batches = rebatch(pulled(src.pieces(start, size)), size, shard_rows, start)
        t = time.perf_counter()
        for batch in batches:
            chunk.append(batch)
        busy += time.perf_counter() - t
        if chunk:
            outbox.send(("batches", _encode(chunk, pool)))
            chunk.clear()
        outbox.send(("end", busy, time.process_time() - cpu))
    except SystemExit:
        return
    except BaseException as exc:  # the job gets the typed error
        try:
            outbox.send(("error", exc))
        except Exception:
            outbox.send(("error", DatasetError(f"reader process: {type(exc).__name__}: {exc}")))
    # Wait for the job's stop: the segments stay until the job unlinks them.
    try:
        while True:
            pool.drain(block=True)
    except (SystemExit, EOFError, OSError):
        pass


# -- the job's side -----------------------------------------------------------------------------


class ProcessReader:
    """The job's end of a reader process: :meth:`chunks` yields each read's batches, views of
    shared memory; :meth:`close` ends the child and unlinks the segments (always call it)."""

    def __init__(self, src: Source, start: int, size: int, shard_rows: int, slots: int = SLOTS) -> None:  # fmt: skip
        ctx = _ctx()
        self.prefix = f"ek{os.getpid()}_{secrets.token_hex(4)}_"
        self._from_child, child_out = ctx.Pipe(duplex=False)
        child_in, self._to_child = ctx.Pipe(duplex=False)
        self._send_lock = threading.Lock()
        self._segments: dict[str, SharedMemory] = {}
        self.read = self.read_cpu = 0.0
        self.proc = ctx.Process(
            target=_child,
            args=(src, start, size, shard_rows, self.prefix, slots, child_out, child_in),
            name="enginekit-read",
            daemon=True,
        )
        self.proc.start()
        child_out.close()
        child_in.close()

    def _release(self, name: str) -> None:
        with self._send_lock:
            try:
                self._to_child.send(("free", name))
            except (OSError, ValueError):
                pass  # the child has ended

    def _segment(self, name: str) -> SharedMemory:
        shm = self._segments.get(name)
        if shm is None:
            shm = self._segments[name] = SharedMemory(name)
        return shm

    def chunks(self) -> Iterator[list[Batch]]:
        """Each read's batches, in the source's order, until the source ends.

        Raises:
            DatasetError: the source's errors, as the thread reader raises them, or the
                reader process ended without a word.
        """
        while True:
            try:
                msg = self._from_child.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                raise DatasetError(
                    f"the Parquet reader process ended unexpectedly (exit code "
                    f"{self.proc.exitcode}); rerun the job, or read in a thread with "
                    "reader='thread' (--reader thread)"
                ) from None
            if msg[0] == "end":
                self.read, self.read_cpu = msg[1], msg[2]
                return
            if msg[0] == "error":
                raise msg[1]
            yield self._decode(msg[1])

    def _decode(self, items: list[Any]) -> list[Batch]:
        bases: dict[str, np.ndarray] = {}
        out = []
        for shard, last, rows, ids, inputs in items:
            feeds = {}
            for k, spec in inputs.items():
                if spec[0] == "array":
                    feeds[k] = spec[1]
                    continue
                _, name, offset, shape, dtype = spec
                base = bases.get(name)
                if base is None:
                    # One base per message and slot: once every batch viewing it is gone,
                    # the slot goes back to the child.
                    base = bases[name] = np.frombuffer(self._segment(name).buf, np.uint8)
                    weakref.finalize(base, self._release, name)
                dt = np.dtype(dtype)
                n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                feeds[k] = base[offset : offset + n].view(dt).reshape(shape)
            out.append(Batch(shard, last, Piece(ids, feeds, rows)))
        return out

    def close(self) -> None:
        """End the child (asked, then terminated, then killed), reap it, unlink the segments."""
        with self._send_lock:
            try:
                self._to_child.send(("stop",))
            except (OSError, ValueError):
                pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc.close()
        self._from_child.close()
        with self._send_lock:
            self._to_child.close()
        names = set(self._segments)
        try:
            names |= {n for n in os.listdir("/dev/shm") if n.startswith(self.prefix)}
        except OSError:
            pass
        for name in names:
            shm = self._segments.get(name)
            try:
                if shm is None:
                    shm = SharedMemory(name)
                shm.unlink()
            except FileNotFoundError:
                pass
            try:
                if shm is not None:
                    shm.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with it
