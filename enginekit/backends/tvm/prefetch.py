"""Software prefetch of a register tile's epilogue reads (a residual add's input).

A kernel's register tile (:mod:`.reduction`) reads its fused epilogue's other inputs (the
residual of ``conv + x``, a bias) only in its write-back, after the tile's reduction: at
batch 16 each of the demo CNN's 32-channel 3x3 convs + residual add read 8 MB of residual
that way, 1 KiB per tile in a burst of demand misses the hardware prefetcher did not cover
(alone, one thread: 7.9 ms against 5.9 without the add). This pass, run on the lowered
kernels, issues a prefetch of every cache line those reads touch at the start of the tile,
before its reduction loop, so they arrive while the tile computes (6.5 ms).

It looks only at a parallel loop whose body allocates a tile (an ``AllocBuffer``) and ends
with its write-back after the last inner loop (the reduction): the ``global`` buffer reads of
that write-back whose address is known before the reduction (it depends on no loop inside
the body and on no value bound after its start).
"""

from __future__ import annotations

from typing import Any

#: Bytes per prefetched line.
LINE = 64


def _vars(expr: Any) -> list[Any]:
    import tvm_ffi
    from tvm import tirx

    found: list[Any] = []
    tvm_ffi.structural_walk(expr, lambda v: found.append(v) if isinstance(v, tirx.Var) else None)
    return found


def _loads(stmts: list[Any]) -> list[Any]:
    import tvm_ffi

    found: list[Any] = []
    # TVM 0.27's Python class of a buffer load is ``TensorLoad`` (``tirx.BufferLoad`` is a
    # constructor function, not a class).
    for stmt in stmts:
        tvm_ffi.structural_walk(
            stmt,
            lambda v: found.append(v) if type(v).__name__ in ("BufferLoad", "TensorLoad") else None,
        )
    return found


def _binds(stmts: list[Any]) -> list[Any]:
    import tvm_ffi
    from tvm import tirx

    found: list[Any] = []
    for stmt in stmts:
        tvm_ffi.structural_walk(
            stmt, lambda v: found.append(v) if isinstance(v, tirx.Bind) else None
        )
    return found


def _loop_vars(stmts: list[Any]) -> list[Any]:
    import tvm_ffi
    from tvm import tirx

    found: list[Any] = []
    for stmt in stmts:
        tvm_ffi.structural_walk(
            stmt, lambda v: found.append(v.loop_var) if isinstance(v, tirx.For) else None
        )
    return found


def _prefetches(loads: list[Any], later: dict[Any, Any], inner: list[Any]) -> list[Any]:
    """One prefetch per cache line of each load whose address is known before ``later``'s
    bindings and ``inner``'s loops."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.tirx.expr import Ramp

    calls, seen = [], set()
    for load in loads:
        buffer = load.source if hasattr(load, "source") else load.buffer
        if buffer.scope() != "global" or len(load.indices) != 1:
            continue
        index = load.indices[0]
        lanes = int(index.lanes) if isinstance(index, Ramp) else 1
        base = index.base if isinstance(index, Ramp) else index
        for _ in range(len(later) + 1):  # bindings may refer to earlier ones
            base = tvm_ffi.structural_map(
                base, lambda v: later.get(v, v) if isinstance(v, tirx.Var) else v
            )
        if any(any(v.same_as(u) for u in (*inner, *later)) for v in _vars(base)):
            continue
        width = tvm.DataType(buffer.dtype).bits // 8
        for offset in range(0, lanes * width, LINE):
            key = (buffer.name, str(base), offset)
            if key in seen:
                continue
            seen.add(key)
            address = tirx.address_of(tirx.BufferLoad(buffer, [base + offset // width]))
            i32 = [tirx.const(v, "int32") for v in (0, 3, 1)]  # read, keep in all caches, data
            calls.append(tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address, *i32)))
    return calls


def _prefetch_tile(loop: Any) -> Any:
    from tvm import tirx

    if loop.kind != tirx.ForKind.PARALLEL or not isinstance(loop.body, tirx.SeqStmt):
        return loop
    seq = list(loop.body.seq)
    loops = [i for i, s in enumerate(seq) if isinstance(s, tirx.For)]
    if not loops or not any(isinstance(s, tirx.AllocBuffer) for s in seq[: loops[-1]]):
        return loop
    at = loops[-1]
    # Every value bound from the reduction on, at any depth (CSE binds index parts inside
    # the write-back too): substituted where it can be, never referenced before its binding.
    later = {b.var: b.value for b in _binds(seq[at:])}
    calls = _prefetches(_loads(seq[at + 1 :]), later, _loop_vars(seq[at:]))
    if not calls:
        return loop
    body = tirx.SeqStmt(seq[:at] + calls + seq[at:])
    return tirx.For(
        loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
        loop.annotations,
    )  # fmt: skip


def prefetch_epilogues(mod: Any) -> Any:
    """``mod`` (lowered TIR) with its register tiles' epilogue reads prefetched."""
    import tvm_ffi
    from tvm import tirx

    return tvm_ffi.structural_map(mod, ((tirx.For, _prefetch_tile),))
