"""Rows cut into engine batches that never cross a shard boundary."""

from __future__ import annotations

import dataclasses
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
