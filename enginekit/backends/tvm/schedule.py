"""Default CPU schedules for TIR kernels that were not tuned.

TVM 0.27 lowers Relax operators to naive loop nests; on CPU its stock pipeline neither
parallelizes nor vectorizes them (measured 30-70x slower than ONNX Runtime on a small ResNet).
DLight's CPU rules only cover GEMV and softmax/norm-style reductions. This module adds one
rule, applied before them, that schedules what a CNN or MLP spends its time in:

- a kernel with one reduction block (conv2d, matmul, pooling, mean): spatial loops outside,
  reduction loops inside, an output tile of ``block x vector`` elements accumulated in
  registers (``cache_write`` to local), the outer spatial loops fused and parallel, the fused
  epilogue (bias, residual add, activation) computed on the tile while it is hot, and padding
  inlined where it does not touch the vectorized axis;
- a kernel of injective blocks only (transpose, add, reshape copies): inlined into each other
  where possible, outer loops parallel, inner loop vectorized.

Kernels the rule cannot handle are left to DLight's rules, then to TVM's defaults.

This module is the rule's entry point: it classifies a kernel's blocks, pads symbolic rows,
picks serial or parallel loops (or both, chosen at run time) and schedules row reductions over
a symbolic axis. The pieces live beside it: :mod:`.simd` (SIMD lanes, vector and register
block sizes), :mod:`.reduction` (the register-tiled reduction), :mod:`.placement` (padding
inlining, window convs, channel-tile placement), :mod:`.rows` (a matmul's padded rows),
:mod:`.packing` (weight repacking and run-time branches), :mod:`.injective`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from enginekit.backends.tvm.injective import _schedule_injective
from enginekit.backends.tvm.knobs import Knobs, kernel_key
from enginekit.backends.tvm.packing import _Chosen, _PackConflict
from enginekit.backends.tvm.reduction import _schedule_reduction
from enginekit.backends.tvm.rows import _sequence_rows
from enginekit.backends.tvm.simd import _extent, _rows_block, vector_lanes

log = logging.getLogger(__name__)


#: Iterations of a kernel's heaviest block (multiply-adds of a conv or matmul, elements of
#: an elementwise kernel) below which it runs on one thread: a parallel launch costs more
#: than such a kernel's work, and under load it waits for a descheduled worker.
PARALLEL_WORK = 1 << 16


def _work(func: Any) -> tuple[int, Any] | None:
    """(static product, symbolic product or None) of the heaviest block's iteration domain."""
    from tvm import s_tir
    from tvm.s_tir import dlight

    infos = dlight.normalize_prim_func(s_tir.Schedule(func))
    if not infos:
        return None
    main = next((b for b in infos if not b.is_injective()), infos[-1])
    static, symbolic = 1, None
    for it in main.iters:
        dom = it.dom
        if isinstance(dom, int):
            static *= dom
        else:
            symbolic = dom if symbolic is None else symbolic * dom
    return static, symbolic


def _weights_over_a_sequence(func: Any, symbolic: Any) -> bool:
    """Whether ``func`` has constant (layout-free) weights and its heaviest block's symbolic
    extent is a product of two or more dims (batch x sequence)."""
    from tvm import tirx

    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    return bool(free) and len(tirx.analysis.undefined_vars(symbolic)) >= 2


def schedule_cpu(func: Any, lanes: int, choices: bool = True, knobs: Knobs | None = None) -> Any:
    """A schedule for ``func`` (a TIR PrimFunc), or None where the rule does not apply.

    Small kernels (below :data:`PARALLEL_WORK`) get serial loops; one whose size depends on a
    symbolic dim (the batch) and may fall either side gets both schedules, chosen at run time.
    ``knobs`` (a tuner's choices, :mod:`.knobs`) override the default's where they fit.
    """
    try:
        return _schedule_cpu(func, lanes, choices, pack=True, knobs=knobs)
    except _PackConflict:  # schedules chosen at run time that want two layouts of a weight
        return _schedule_cpu(func, lanes, choices, pack=False, knobs=knobs)


def _schedule_cpu(
    func: Any, lanes: int, choices: bool, pack: bool, knobs: Knobs | None = None
) -> Any:
    work = _work(func)
    if work is None:
        return None
    static, symbolic = work
    if choices and symbolic is not None and _weights_over_a_sequence(func, symbolic):
        # A matmul with constant weights over batch x sequence rows (a transformer's
        # projections): the product is rarely small, and one parallel schedule gets its
        # weights repacked (measured when a run-time choice kept them unpacked: small BERT's
        # Q/K/V projections without static shapes, 2.7 ms against 1.9 packed at batch 16).
        return _schedule(func, lanes, True, choices, pack)
    if not choices or symbolic is None or static >= PARALLEL_WORK:
        parallel = static >= PARALLEL_WORK or symbolic is not None
        if knobs is not None and knobs.parallel is not None:
            parallel = knobs.parallel
        return _schedule(func, lanes, parallel, choices, pack, knobs)
    # Both schedules repack the weights alike; _Chosen hoists the repackings out of the
    # branches (TVM splits out only a repacking block at the function's top level).
    parallel = _schedule(func, lanes, True, pack=pack)
    serial = _schedule(func, lanes, False, pack=pack)
    if parallel is None or serial is None:
        return parallel
    # Either may itself be a choice (a matmul's padded rows): the choices nest.
    return _Chosen(parallel, serial, symbolic * static >= PARALLEL_WORK)


def _reduces(sch: Any, info: Any) -> bool:
    """Whether a block reduces: a reduction iterator, or an init statement (a matmul over
    K = 1, an outer product, keeps its init once its unit reduction loop is normalized away;
    DLight then calls it injective, and TVM 0.27 inlining an epilogue into it applies the
    epilogue to the init and the update both: ``x @ w + b`` added ``b`` twice)."""
    return not info.is_injective() or sch.get(info.block_rv).init is not None


def _schedule(
    func: Any,
    lanes: int,
    parallel: bool,
    choices: bool = True,
    pack: bool = True,
    knobs: Knobs | None = None,
) -> Any:
    """:func:`schedule_cpu` with or without parallel loops."""
    from tvm import s_tir
    from tvm.s_tir import dlight

    sch = s_tir.Schedule(func)
    infos = dlight.normalize_prim_func(sch)
    if not infos:
        return None
    reductions = [i for i, b in enumerate(infos) if _reduces(sch, b)]
    if not reductions:
        for info in dlight.try_inline(sch, infos):
            _schedule_injective(sch, info.block_rv, lanes, parallel)
        return sch
    if len(reductions) == 1:
        rows, vector = _symbolic_axes(sch, infos[reductions[0]])
        if vector:
            # Always padded: unpadded, the symbolic vector axis would not be vectorized.
            padded = s_tir.Schedule(func)
            if _pad_symbolic(padded, lanes, vector=True):
                infos_p = dlight.normalize_prim_func(padded)
                index = next(i for i, b in enumerate(infos_p) if _reduces(padded, b))
                _schedule_reduction(
                    padded, infos_p, index, lanes, parallel, pack=False, padded=True
                )
                return padded
        padded = s_tir.Schedule(func) if rows is not None and choices else None
        if padded is not None and _pad_symbolic(padded, lanes, vector=False):
            # Two schedules of one kernel, chosen at run time by the symbolic row count: rows
            # padded to the register block (many rows: each weight vector is reused by a
            # block of rows), or wide vector tiles on unpadded rows (one to three rows, e.g.
            # batch 1, where padding would multiply a memory-bound GEMV's work by four).
            infos_p = dlight.normalize_prim_func(padded)
            index = next(i for i, b in enumerate(infos_p) if _reduces(padded, b))
            if _sequence_rows(sch, infos[reductions[0]]):
                # Rows that are a sequence within a batch (a transformer's projections): few
                # enough for the unpadded branch only at a sequence of 1 to 3. Padded alone,
                # its constant weights are repacked (measured when a run-time choice kept them
                # unpacked: a small BERT's feed-forward matmuls without static shapes ran
                # 1.5x slower).
                _schedule_reduction(padded, infos_p, index, lanes, parallel, pack, padded=True)
                return padded
            # Both branches read one packed weight: the unpadded one's wide tile takes the
            # padded one's tiles where they divide it.
            width = _schedule_reduction(padded, infos_p, index, lanes, parallel, pack, padded=True)
            _schedule_reduction(sch, infos, reductions[0], lanes, parallel, pack, pack_width=width)
            return _Chosen(padded, sch, rows >= _rows_block(lanes))
        _schedule_reduction(sch, infos, reductions[0], lanes, parallel, pack, knobs=knobs)
        return sch
    if _extent(sch, sch.get_loops(infos[-1].block_rv)[-1]) is None:
        return _schedule_rows(sch, lanes, parallel)
    return None  # softmax, layer norm over a static axis: DLight's Reduction rule


def _symbolic_axes(sch: Any, info: Any) -> tuple[Any, bool]:
    """(the symbolic extent of a reduction's row axis, or None; whether its innermost (vector)
    axis is symbolic); (None, False) for a kernel with one spatial axis.

    The rows are a matmul's batch or batch x sequence; a symbolic vector axis is an attention
    score matrix's keys (``Q @ K^T`` over a symbolic sequence)."""
    kinds = info.dom_kind()
    loops = sch.get_loops(info.block_rv)
    spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
    if len(spatial) < 2:
        return None, False
    rows = None if _extent(sch, spatial[-2]) is not None else sch.get(spatial[-2]).extent
    return rows, _extent(sch, spatial[-1]) is None


def _pad_symbolic(sch: Any, lanes: int, vector: bool) -> bool:
    """Pad the symbolic row axis of the one reduction block to a multiple of the register
    block, and with ``vector`` its symbolic innermost axis to two vectors; returns whether
    it did.

    Without it the rows cannot be blocked: splitting a symbolic extent leaves a predicate in
    the block, and TVM then keeps the accumulator as a batch-sized array in memory instead of
    registers (measured 2x slower than not blocking). ``pad_einsum`` instead computes the
    padded rows (the input padded with zeros on the fly, the output copied back), so the
    row loop splits exactly. A symbolic innermost axis unpadded was not vectorized at all:
    one scalar multiply-add chain per output element, its indices recomputed by symbolic
    divisions (a small BERT's attention scores without static shapes: 13 of 31 ms).
    """
    from tvm.s_tir import dlight

    infos = dlight.normalize_prim_func(sch)
    info = next(b for b in infos if _reduces(sch, b))
    kinds = info.dom_kind()
    loops = sch.get_loops(info.block_rv)
    spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
    padding = []
    for lp in loops:
        if lp.same_as(spatial[-2]) and _extent(sch, lp) is None:
            padding.append(_rows_block(lanes))
        elif vector and lp.same_as(spatial[-1]):
            padding.append(2 * lanes)
        else:
            padding.append(1)
    try:
        sch.pad_einsum(info.block_rv, padding)
    except Exception:  # not an einsum (a conv's window access): left unpadded
        return False
    return True


def _schedule_rows(sch: Any, lanes: int, parallel: bool) -> Any:
    """Row reductions over a symbolic innermost axis (softmax over a symbolic sequence): the
    elementwise blocks inlined, the reductions computed per row under the output's row loop
    (parallel), each inner loop one plain loop over the row.

    DLight's Reduction rule split the symbolic row into vectors of 16 with a predicate,
    which scalarized every one of its blocks, and kept each intermediate (exponentials,
    normalized values, a NaN mask) as a tensor of the input's size in memory: a small BERT's
    attention softmax without static shapes took 3x its static form.

    An elementwise block that a row reduction reads and a later block reads too (softmax's
    exponentials: summed, then divided) is computed once per row into its buffer instead:
    inlined, its work was done twice, and neither copy was a plain elementwise loop that LLVM
    vectorizes (one softmax over 2048 rows of 32, one thread: 0.29 -> 0.10 ms).
    """
    from tvm.s_tir import dlight

    infos = dlight.normalize_prim_func(sch)
    for info in infos[:-1]:
        if info.is_injective() and not _shared_with_a_reduction(sch, info.block_rv):
            sch.compute_inline(info.block_rv)
    infos = dlight.normalize_prim_func(sch)
    *producers, out = infos
    if not any(_reduces(sch, r) for r in producers):
        return None
    loops = sch.get_loops(out.block_rv)
    if len(loops) < 2:
        return None
    # The outer row loops fused and parallel, the last one (the query of attention scores)
    # kept: fused over it, every block recovered its indices by symbolic divisions per row
    # (a small BERT's softmax at batch 16: a third of its time).
    if len(loops) > 3:
        top, rows = sch.fuse(*loops[:-2]), loops[-2]
    else:
        top = rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    if parallel:
        sch.parallel(top)
    for info in reversed(producers):
        sch.compute_at(info.block_rv, rows, preserve_unit_loops=True)
    for info in producers:
        _vectorize_partial(sch, info.block_rv)
    return sch


def _vectorize_partial(sch: Any, block: Any) -> None:
    """A reduction block with a static spatial axis besides the row (the running results of
    fastmath's split reduction: ``[row, parts]`` over ``k``): that axis innermost, vectorized,
    so each step of ``k`` is one vector operation on independent accumulators."""
    from tvm import tirx

    iters = sch.get(block).iter_vars
    reduce = [it.iter_type == tirx.IterVar.CommReduce for it in iters]
    if not any(reduce):
        return
    loops = sch.get_loops(block)[-len(iters) :]
    lanes = [lp for lp, red in zip(loops, reduce) if not red and (_extent(sch, lp) or 1) > 1]
    if len(lanes) != 1:
        return
    red = [lp for lp, r in zip(loops, reduce) if r]
    try:
        sch.reorder(*red, lanes[0])
        sch.vectorize(lanes[0])
    except Exception:  # bindings TVM cannot prove affine (an int32 dim among int64 ones)
        log.debug("split reduction %s left unvectorized", sch.get(block).name_hint)


def _shared_with_a_reduction(sch: Any, block: Any) -> bool:
    """Whether a reduction block and another block both read ``block``'s output."""
    from tvm import tirx

    consumers = sch.get_consumers(block)
    if len(consumers) < 2:
        return False
    reduce = tirx.IterVar.CommReduce
    return any(any(it.iter_type == reduce for it in sch.get(c).iter_vars) for c in consumers)


def cpu_rules(
    target: Any, choices: bool = True, knobs: Mapping[str, Knobs] | None = None
) -> list[Any]:
    """Schedule rules for ``dlight.ApplyDefaultSchedule`` on an LLVM target, best first
    (``choices=False``: one schedule per kernel, none chosen at run time; ``knobs``: a
    tuner's choices by :func:`.knobs.kernel_key`)."""
    from tvm import tirx
    from tvm.s_tir import dlight

    lanes = vector_lanes(target)

    class EnginekitCPU(dlight.ScheduleRule):
        """enginekit's tiled, parallel, vectorized CPU schedule (see the module docstring)."""

        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc):
                return None
            try:
                chosen = knobs.get(kernel_key(func)) if knobs else None
                sch = schedule_cpu(func, lanes, choices, chosen)
                # A list is what ApplyDefaultSchedule accepts besides a Schedule.
                return [sch] if isinstance(sch, _Chosen) else sch
            except Exception as exc:  # a pattern the rule misjudged: leave it to the next rule
                log.debug("enginekit CPU schedule does not apply: %s", str(exc).split("\n")[0])
                return None

    return [EnginekitCPU(), dlight.cpu.GEMV(), dlight.cpu.Reduction()]


def gpu_rules() -> list[Any]:
    """DLight's GPU rules: every kernel gets thread bindings (CUDA code needs them)."""
    from tvm.s_tir import dlight

    return [
        dlight.gpu.Matmul(),
        dlight.gpu.GEMV(),
        dlight.gpu.Reduction(),
        dlight.gpu.GeneralReduction(),
        dlight.gpu.Fallback(),
    ]
