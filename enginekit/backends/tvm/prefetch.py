"""Software prefetch in register-tiled kernels: a tile's epilogue reads (a residual add's
input, :func:`prefetch_epilogues`) and a weight-bound kernel's weight stream
(:func:`prefetch_streams`).

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
        if tvm.DataType(str(base.ty)).lanes != 1:
            # A vector of addresses (a Broadcast index, as MetaSchedule's schedules write for
            # one value read into every lane): no single line to prefetch, and LLVM refuses a
            # vector index in an address ("Expected buffer index to be an integer").
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


#: Loop annotation the schedule puts on the tile loop of a weight-bound kernel with a large
#: weight (:func:`.placement._streams_weights`): its weight is read once per call at batch 1,
#: from memory, not from cache (ResNet-50's last stage at 64x64 inputs reads 9 MB per 3x3
#: conv). The hardware prefetcher alone kept one core at ~21-23 GB/s on this stream.
STREAM = "enginekit_stream_weights"

#: How far ahead (bytes) a marked tile's weight stream is prefetched, in every step of its
#: innermost reduction loop (one prefetch per cache line the step reads). ResNet-50 at batch
#: 1, one thread, CPU time per call against none, with the 8 x 2 tiles of round 16: 1024 B
#: 0.97, 2048 B 0.92-0.96, 4096 B 0.89-0.93, 8192 B 0.91 (medians of 11 alternating rounds,
#: loaded host). Since layer3's tiles read each weight vector once for 16 FMAs
#: (:func:`.placement._single_pass_rows`), 8192 B: layer3 0.74 ms against 0.79 at 4096 B
#: (two threads, two builds of each alternating, medians of 21 rounds, the VM's per-kernel
#: times); layer4 and the rest unchanged, 16384 B no better.
STREAM_AHEAD = 8192


def _innermost(stmt: Any) -> Any:
    """The innermost ``For`` of a perfect-ish loop nest (each body a For, or a SeqStmt with one
    For and nothing else looping), or None."""
    from tvm import tirx

    loop = stmt if isinstance(stmt, tirx.For) else None
    while loop is not None:
        inner = [s for s in _seq(loop.body) if isinstance(s, tirx.For)]
        if not inner:
            return loop
        if len(inner) > 1:
            return None
        loop = inner[0]
    return None


def _seq(stmt: Any) -> list[Any]:
    from tvm import tirx

    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def _stream_prefetches(loop: Any) -> list[Any]:
    """Prefetches ``STREAM_AHEAD`` bytes ahead of each contiguous vector stream the loop's
    body reads from a ``global`` buffer: loads whose bases advance, per iteration, by exactly
    the span they cover together (a packed weight tile)."""
    import tvm
    import tvm_ffi
    from tvm import sym, tirx
    from tvm.tirx.expr import Ramp

    body = _seq(loop.body)
    binds = {b.var: b.value for b in _binds(body)}
    var = loop.loop_var
    analyzer = sym.Analyzer()
    streams: dict[str, list[Any]] = {}
    buffers: dict[str, Any] = {}
    for load in _loads(body):
        buffer = load.source if hasattr(load, "source") else load.buffer
        if buffer.scope() != "global" or len(load.indices) != 1:
            continue
        index = load.indices[0]
        if not isinstance(index, Ramp) or not isinstance(index.stride, tirx.IntImm):
            continue
        if int(index.stride) != 1:
            continue
        base = index.base
        for _ in range(len(binds) + 1):
            base = tvm_ffi.structural_map(
                base, lambda v: binds.get(v, v) if isinstance(v, tirx.Var) else v
            )
        streams.setdefault(buffer.name, []).append((analyzer.simplify(base), int(index.lanes)))
        buffers[buffer.name] = buffer
    calls = []
    for name, loads in streams.items():
        buffer = buffers[name]
        first = loads[0][0]
        offsets = []
        for base, lanes in loads:
            delta = analyzer.simplify(base - first)
            if not isinstance(delta, tirx.IntImm):
                break
            offsets.append((int(delta), lanes))
        else:
            low = min(o for o, _ in offsets)
            span = max(o + n for o, n in offsets) - low
            step = analyzer.simplify(
                tvm_ffi.structural_map(
                    first, lambda v: var + 1 if isinstance(v, tirx.Var) and v.same_as(var) else v
                )
                - first
            )
            width = tvm.DataType(buffer.dtype).bits // 8
            if not isinstance(step, tirx.IntImm) or int(step) != span or span * width < LINE:
                continue
            ahead = STREAM_AHEAD // width
            for offset in range(0, span * width, LINE):
                index = first + (low + ahead + offset // width)
                address = tirx.address_of(tirx.BufferLoad(buffer, [index]))
                i32 = [tirx.const(v, "int32") for v in (0, 3, 1)]
                calls.append(
                    tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address, *i32))
                )
    return calls


def _prefetch_stream(loop: Any) -> Any:
    from tvm import tirx

    if STREAM not in (loop.annotations or {}):
        return loop
    annotations = {k: v for k, v in loop.annotations.items() if k != STREAM}
    seq = _seq(loop.body)
    fors = [i for i, s in enumerate(seq) if isinstance(s, tirx.For)]
    if not fors or not any(isinstance(s, tirx.AllocBuffer) for s in seq[: fors[0]]):
        return loop
    changed = False
    for i in fors:
        inner = _innermost(seq[i])
        if inner is None or inner.kind != tirx.ForKind.SERIAL:
            continue
        calls = _stream_prefetches(inner)
        if not calls:
            continue
        new_inner = tirx.For(
            inner.loop_var, inner.min, inner.extent, inner.kind,
            tirx.SeqStmt(calls + _seq(inner.body)), inner.thread_binding, inner.annotations,
        )  # fmt: skip
        seq[i] = _replace(seq[i], inner, new_inner)
        changed = True
    body = tirx.SeqStmt(seq) if changed else loop.body
    return tirx.For(
        loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, annotations
    )


def _replace(stmt: Any, old: Any, new: Any) -> Any:
    import tvm_ffi
    from tvm import tirx

    return tvm_ffi.structural_map(stmt, ((tirx.For, lambda f: new if f.same_as(old) else f),))


def prefetch_streams(mod: Any) -> Any:
    """``mod`` (lowered TIR) with the weight stream of each tile loop marked :data:`STREAM`
    (by the schedule: a weight-bound kernel with a large weight) prefetched
    :data:`STREAM_AHEAD` bytes ahead in its reduction loop; the mark is removed."""
    import tvm_ffi
    from tvm import tirx

    return tvm_ffi.structural_map(mod, ((tirx.For, _prefetch_stream),))
