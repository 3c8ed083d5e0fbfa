"""The default CPU schedule of injective blocks (transposes, elementwise epilogues, copies):
outer loops fused and parallel, the innermost loop vectorized (see :mod:`.schedule`)."""

from __future__ import annotations

from typing import Any

from enginekit.backends.tvm.simd import _extent, _vector_factor


def _schedule_injective(sch: Any, block: Any, lanes: int, parallel: bool = True) -> None:
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    extent = _extent(sch, inner)
    factor = _vector_factor(extent, lanes)
    outer = list(loops[:-1])
    if factor is not None and factor > 1:
        if factor == extent:
            vec = inner
        else:
            o, vec = sch.split(inner, [None, factor])
            outer.append(o)
        sch.vectorize(vec)
    elif extent is not None or not outer:
        outer.append(inner)
    # A symbolic innermost axis (a sequence) stays a loop of its own: fused into the parallel
    # loop, every element recomputed its indices by symbolic divisions (a transpose over a
    # symbolic sequence in a small BERT: 1.1 ms where its static form took 0.1).
    outer = _unfused_symbolic(sch, outer)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(fused)


def _unfused_symbolic(sch: Any, outer: list[Any]) -> list[Any]:
    """The leading ``outer`` loops to fuse into the parallel loop; the rest stay serial in it.

    Fused past the batch, a symbolic extent is divided by per parallel iteration (one vector
    of the output): a head transpose ``[b, 4, seq, 32]`` recovered ``b``, the head and the
    position with divisions by ``seq``. The loops before the last symbolic one are fused
    alone where they are several (the batch and the heads: divisions by constants), else
    through it, the static loops after it left out (``[b, seq, 4 x 32]``: the divisions
    once per row instead of per vector).
    """
    symbolic = [i for i, lp in enumerate(outer) if _extent(sch, lp) is None]
    if not symbolic or symbolic[-1] == 0:
        return outer
    last = symbolic[-1]
    static = 1
    for lp in outer[:last]:
        static *= _extent(sch, lp) or 1
    return outer[:last] if static >= 2 else outer[: last + 1]
