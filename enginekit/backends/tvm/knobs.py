"""The choices enginekit's default CPU schedule makes, as knobs a tuner may set per kernel.

Every knob left ``None`` keeps the default schedule's own choice (:mod:`.schedule`), so
``Knobs()`` is the untuned schedule. A knob that does not fit a kernel (a row block that
does not divide its rows, a tile width that does not divide its channels) is ignored for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Overrides of the default schedule's choices for one kernel (None: the default's).

    Attributes:
        rows: register-block rows of the second-innermost output axis (1: no row block).
        vectors: the register tile's width in SIMD vectors along the innermost output axis.
        tiles_outer: the output-channel tile loop outermost (True) or innermost (False)
            among the parallel loops.
        parallel: the outer loops parallel (True) or serial (False).
    """

    rows: int | None = None
    vectors: int | None = None
    tiles_outer: bool | None = None
    parallel: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """The knobs that are set, as a JSON object."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Knobs:
        """Knobs from :meth:`to_json`'s object (unknown keys are an error)."""
        return cls(**dict(data))


#: Row blocks and tile widths (vectors) a tuner tries, on top of the default's choice.
ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
VECTORS = (1, 2, 4)


def space() -> Iterator[Knobs]:
    """Candidate knobs, one knob changed first, then row block x tile width pairs.

    ``parallel`` is not among them: timed on a loaded 2-core host (load 3-4), serial loops
    won in 25 of ResNet-50's 29 kernels -- a parallel loop waits for a descheduled worker --
    a choice that halves the speed of the big convolutions on a quiet host."""
    for rows in ROWS:
        yield Knobs(rows=rows)
    for vectors in VECTORS:
        yield Knobs(vectors=vectors)
    for outer in (True, False):
        yield Knobs(tiles_outer=outer)
    for vectors in VECTORS:
        for rows in ROWS:
            yield Knobs(rows=rows, vectors=vectors)
    for outer in (True, False):
        for rows in ROWS:
            yield Knobs(rows=rows, tiles_outer=outer)


def kernel_key(func: Any) -> str:
    """A kernel's identity across models and builds: the structural hash of its TIR
    (its global symbol left out, so a kernel shared between models gets one key)."""
    import tvm_ffi

    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")
    return f"{int(tvm_ffi.structural_hash(func)) & 0xFFFFFFFFFFFFFFFF:016x}"
