"""Rows cut into engine batches that never cross a shard boundary, and the queue that hands
them from a job's reader to its engine."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from enginekit.dataset.sources import Piece, slice_piece


@dataclasses.dataclass
class Batch:
    """A batch of rows, the shard it belongs to, and whether it ends that shard."""

    shard: int
    last: bool  # the last batch of its shard
    piece: Piece


def rebatch(pieces: Iterator[Piece], size: int, shard_rows: int, start: int) -> Iterator[Batch]:
    """Cut pieces into batches of ``size`` rows that never cross a shard boundary (``start`` is
    a shard boundary); the final batch of the source may be shorter."""
    buf: list[Piece] = []
    have = 0
    row = start

    def take(n: int) -> Piece:
        nonlocal buf, have
        out: list[Piece] = []
        need = n
        while need:
            p = buf[0]
            if p.rows <= need:
                out.append(buf.pop(0))
                need -= p.rows
            else:
                out.append(slice_piece(p, 0, need))
                buf[0] = slice_piece(p, need, p.rows)
                need = 0
        have -= n
        return out[0] if len(out) == 1 else concat(out)

    def target() -> int:
        return min(size, shard_rows - row % shard_rows)

    for p in pieces:
        if not p.rows:
            continue
        buf.append(p)
        have += p.rows
        while have >= target():
            n = target()
            shard, row = row // shard_rows, row + n
            yield Batch(shard, row % shard_rows == 0, take(n))
    while have:
        n = min(have, target())
        shard, row = row // shard_rows, row + n
        yield Batch(shard, row % shard_rows == 0 or have == n, take(n))


def concat(pieces: Sequence[Piece]) -> Piece:
    """The rows of several pieces as one (copies: the engine wants one contiguous batch)."""
    ids = concat_ids([p.ids for p in pieces])
    inputs = {k: np.concatenate([p.inputs[k] for p in pieces]) for k in pieces[0].inputs}
    return Piece(ids, inputs, sum(p.rows for p in pieces))


def concat_ids(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Id columns of consecutive pieces, joined per column."""
    import pyarrow as pa

    return {k: pa.concat_arrays([_chunk(p[k]) for p in parts]) for k in parts[0]}


def _chunk(col: Any) -> Any:
    import pyarrow as pa

    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


class BatchQueue:
    """Batches from a dataset job's reader, queued a read's worth at a time (one wake-up per
    read), taken one at a time in order by the engine's streams; at most ``prefetch`` batches
    queued (a read larger than that is queued whole once the queue is empty).

    Counting the batches not yet taken, not the reads, keeps what is read ahead small: the
    engine's next batch was written by the reader recently enough to be in the caches."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.batches: collections.deque[Batch] = collections.deque()
        self.closed = False
        self.waiting = 0  # batches the reader waits to queue (0: it does not wait)
        self.taken = 0  # batches taken: the next one's sequence number
        self.cond = threading.Condition()

    def _room(self, n: int) -> bool:
        return not self.batches or len(self.batches) + n <= self.prefetch

    def put(self, chunk: list[Batch], stop: threading.Event) -> bool:
        """Queue ``chunk``'s batches; False once ``stop`` is set."""
        with self.cond:
            while not self._room(len(chunk)):
                if stop.is_set():
                    return False
                self.waiting = len(chunk)
                self.cond.wait(0.1)
            self.waiting = 0
            self.batches.extend(chunk)
            self.cond.notify_all()
        return not stop.is_set()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def get(self, stop: threading.Event) -> tuple[int, Batch] | None:
        """The next batch and its sequence number; None at the end or once ``stop`` is set."""
        with self.cond:
            while not self.batches:
                if self.closed or stop.is_set():
                    return None
                self.cond.wait(0.1)
            batch = self.batches.popleft()
            self.taken += 1
            if self.waiting and self._room(self.waiting):
                self.cond.notify_all()  # the reader: only once its read fits
            return self.taken - 1, batch
