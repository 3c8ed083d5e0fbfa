"""A matmul's rows in the default CPU schedule (see :mod:`.schedule`): symbolic rows padded
to the register block (copied per parallel task when they are a sequence), and the
half-vector tiles of padded rows on AVX-512."""

from __future__ import annotations

from typing import Any

from enginekit.backends.tvm.packing import _layout_free
from enginekit.backends.tvm.simd import _extent, _row_factor

#: Rows of a padded-row tile made of half vectors (AVX-512), and its widest vector count.
_HALF_ROWS, _HALF_WIDE = 4, (5, 4, 3)


def _half_vector_rows(
    sch: Any, rows: Any, v_extent: int | None, fv: int, lanes: int
) -> tuple[int | None, int]:
    """(the row block, the tile width) of a matmul over padded symbolic rows whose columns
    take only half vectors on AVX-512 (a 1000-class classifier: 1000 = 125 x 8): 4 rows x 5
    half vectors instead of 8 rows x 1, so that each step loads 5 weight vectors and 4 row
    values for 20 FMAs, where it loaded 1 and 8 for 8 (1024x1000 at batch 16 alone, one
    thread, packed weights: 790 -> 710 us and 1260 -> 920 us in two runs; 2048x1000 2130 ->
    1640 us). Unpacked, the weight rows 4 KiB apart, it measured no gain. (None, ``fv``)
    where it does not apply."""
    if (
        lanes < 16
        or fv != lanes // 2
        or v_extent is None
        or _extent(sch, rows) is not None
        or _row_factor(sch, rows, lanes) % _HALF_ROWS
    ):
        return None, fv
    wide = next((k * fv for k in _HALF_WIDE if v_extent % (k * fv) == 0), None)
    return (_HALF_ROWS, wide) if wide else (None, fv)


def _row_pads(sch: Any, producers: list[Any]) -> list[Any]:
    """The row paddings (``pad_einsum``'s ``*_pad`` blocks) of a kernel with constant weights
    that are copied inside its parallel loop, a block of rows per task, rather than in a
    pass of their own: a matmul over batch x sequence rows (a transformer's projections;
    the caller checks the rows are a sequence, so that a weight-bound matmul over a batch
    keeps its channel tiles outermost).

    Copied in a pass of their own, each projection of the small BERT of ``tvm_bench.py``
    without static shapes made a parallel pass over its input before its matmul (batch 16:
    the calling thread's CPU time per inference, two threads, 7.8 ms where the static module
    took 5.7; one thread 6.2 vs 5.5). Only a padding whose innermost axis is static (the
    reduction's ``K``, copied in vectors): an operand padded along a symbolic axis (``K^T``
    of attention scores, padded along the keys) would be copied again by every row block.
    """
    if not _layout_free(sch):
        return []
    return [
        p
        for p in producers
        if sch.get(p.block_rv).name_hint.endswith("_pad")
        and _extent(sch, sch.get_loops(p.block_rv)[-1]) is not None
    ]


def _sequence_rows(sch: Any, info: Any) -> bool:
    """Whether a reduction's (symbolic) row axis has another spatial axis outside it, as a
    sequence inside a batch (``[batch, seq, K] @ [K, N]``), rather than being the batch."""
    kinds = info.dom_kind()
    return sum(k == "S" for k in kinds) >= 3
