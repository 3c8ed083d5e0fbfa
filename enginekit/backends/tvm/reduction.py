"""The default CPU schedule of a kernel's one reduction block (conv2d, matmul, pooling,
mean; see :mod:`.schedule`): spatial loops outside, reduction loops inside, an output tile
of ``block x vector`` elements accumulated in registers and written back through the fused
epilogue."""

from __future__ import annotations

from typing import Any

from enginekit.backends.tvm.injective import _schedule_injective
from enginekit.backends.tvm.knobs import Knobs
from enginekit.backends.tvm.packing import _pack_weights
from enginekit.backends.tvm.placement import (
    _channel_tiles_at,
    _fuse_short_rows,
    _narrow_window,
    _pads_inner_axis,
    _single_pass_rows,
    _streams_weights,
)
from enginekit.backends.tvm.prefetch import STREAM
from enginekit.backends.tvm.rows import _half_vector_rows, _row_pads, _sequence_rows
from enginekit.backends.tvm.simd import (
    _divides,
    _extent,
    _row_factor,
    _stack_block,
    _static,
    _vector_factor,
    _vectorize,
    _wide_vector_factor,
)


def _fuse_epilogue(sch: Any, writeback: Any, epilogue: list[Any]) -> list[Any]:
    """Fold the injective blocks after a reduction into its register write-back; returns the
    blocks left to schedule on their own.

    Intermediate blocks are first inlined into their consumers (an epilogue such as GELU reads
    ``x`` twice: ``x * erf(x)``), so one block is left to fold into the write-back.
    ``reverse_compute_inline`` is only asked for a block that is the write-back's sole consumer
    and reads nothing else computed in the kernel: TVM 0.27 accepts more and then drops the
    producer of the other buffer, and compilation dies with "Buffer ... is used before its
    definition" (``flat_map_``), as on every ViT/BERT GELU matmul.
    """
    left = list(epilogue)
    for consumer in epilogue[:-1]:
        try:
            sch.compute_inline(consumer.block_rv)
            left.remove(consumer)
        except Exception:  # written to a function output, or not inlinable: kept
            pass
    for consumer in list(left):
        block = sch.get(consumer.block_rv)
        consumers = sch.get_consumers(writeback)
        producers = sch.get_producers(consumer.block_rv)
        if not (
            len(consumers) == 1
            and sch.get(consumers[0]).same_as(block)
            and len(producers) == 1
            and sch.get(producers[0]).same_as(sch.get(writeback))
        ):
            break
        try:
            sch.reverse_compute_inline(consumer.block_rv)
            left.remove(consumer)
        except Exception:  # e.g. a broadcast consumer: scheduled on its own
            break
    return left


def _schedule_reduction(
    sch: Any,
    infos: list[Any],
    index: int,
    lanes: int,
    parallel: bool = True,
    pack: bool = True,
    padded: bool = False,
    pack_width: int | None = None,
    knobs: Knobs | None = None,
) -> int | None:
    """Schedule the reduction ``infos[index]`` (see the module docstring); returns the width
    of the tiles its constant weights were repacked into, None where none was. With
    ``pack_width`` the weights are packed in tiles of that width where it divides the
    register tile's (another schedule of the kernel, chosen at run time, reads the same
    packed weight: one constant instead of one per schedule). ``knobs`` override the row
    block, the tile width and the channel tiles' place where they fit (:mod:`.knobs`)."""
    main = infos[index]
    separate = []
    narrow = _narrow_window(sch, main, lanes)
    for producer in infos[:index]:
        # Padding along an outer axis is a scalar select per vector step: inline it and save a
        # pass over memory. Padding along the vectorized axis would break vectorization. The
        # rows ``pad_einsum`` padded (``padded``) are copied in a pass of their own: inlined,
        # each register row's operand was a select inside the reduction loop (a small BERT's
        # feed-forward matmuls over symbolic rows: 1.3-1.5x slower than their static form;
        # copied, as fast as it).
        if (
            not _pads_inner_axis(sch, producer.block_rv)
            and not (padded and sch.get(producer.block_rv).name_hint.endswith("_pad"))
            and not narrow
        ):
            try:
                sch.compute_inline(producer.block_rv)
                continue
            except Exception:  # not inlinable (several consumers, opaque access)
                pass
        separate.append(producer)
    block = main.block_rv
    loops = sch.get_loops(block)
    kinds = main.dom_kind()
    spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds) if k == "R"]
    if len(spatial) + len(reduce) != len(loops) or not spatial:
        raise ValueError(f"block {main.name} has iterators of kinds {kinds}")
    # The innermost output axis is vectorized; the one before it is register-blocked.
    v = spatial[-1]
    v_extent = _extent(sch, v)
    fv = _vector_factor(v_extent, lanes)
    if v_extent is None and _divides(sch, v, 2 * lanes):
        fv = 2 * lanes  # a symbolic axis padded by _pad_symbolic (a sequence length)
    outer = list(spatial[:-1])
    if (len(reduce) == 1 or _streams_weights(sch, block)) and fv is not None and len(outer) >= 2:
        _fuse_short_rows(sch, outer, lanes)
    if reduce and fv is not None and (not outer or _row_factor(sch, outer[-1], lanes) == 1):
        # No row to block (a matmul over a symbolic batch, a GEMV): one vector of
        # accumulators would be one FMA dependency chain; a wider tile gives several.
        # With ``pack_width`` (the weight another branch packed), a multiple of it.
        fv = _wide_vector_factor(v_extent, lanes, pack_width) or fv
    if (
        reduce
        and fv == 2 * lanes
        and outer
        and v_extent is not None
        and v_extent % (2 * fv) == 0
        and _row_factor(sch, outer[-1], lanes) == 2
    ):
        # A block of 2 pixels x 2 vectors is 4 FMA chains, half what hides the FMA latency:
        # 4 vectors wide instead (ResNet-50's 3x3 convs over 2x2 pixels, 25-30% faster on one
        # thread; 8 accumulators still fit AVX2's 16 registers).
        fv *= 2
    fu_override = None
    width = knobs.vectors * lanes if knobs is not None and knobs.vectors else None
    single = _single_pass_rows(sch, block, outer[-1], v_extent, lanes) if reduce and outer else 0
    if reduce and width and v_extent is not None and v_extent % width == 0:
        fv = width
    elif single:
        fu_override, fv = single, lanes
    elif reduce and outer and fv is not None:
        fu_override, fv = _half_vector_rows(sch, outer[-1], v_extent, fv, lanes)
    if fv is None:
        v_outer, v_inner = v, None
    elif fv == v_extent:
        v_outer, v_inner = None, v
    else:
        v_outer, v_inner = sch.split(v, [None, fv])
    u_inner = None
    if outer and v_inner is not None:
        u = outer[-1]
        u_extent = _extent(sch, u)
        fu = fu_override or _row_factor(sch, u, lanes)
        if fu_override is None and len(reduce) > 1 and fv is not None and _static(sch, block):
            fu = _stack_block(u_extent, fu, fv, lanes)
        if knobs is not None and knobs.rows and u_extent and u_extent % knobs.rows == 0:
            fu = knobs.rows
        if fu > 1:
            outer.pop()
            if fu == u_extent:
                u_inner = u
            else:
                u_outer, u_inner = sch.split(u, [None, fu])
                outer.append(u_outer)
    pads = _row_pads(sch, separate) if padded and _sequence_rows(sch, main) else []
    inner = [lp for lp in (u_inner, v_inner) if lp is not None]
    tile = at = None
    depth = 1  # loops above the write-back: the tile loop, and the channel tiles with pads
    if pads and outer and reduce:
        # The rows padded in tiles: each parallel task copies its block of rows, then runs
        # every channel tile over them (serial inside the task) while the copy is in L1.
        tiles = [v_outer] if v_outer is not None else []
        sch.reorder(*outer, *tiles, *reduce, *inner)
        tile = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(tile)
        at, depth = (v_outer, 2) if v_outer is not None else (tile, 1)
    else:
        pads = []
        if v_outer is not None:
            place = _channel_tiles_at(sch, block, outer, len(spatial))
            if knobs is not None and knobs.tiles_outer is not None:
                place = 0 if knobs.tiles_outer else len(outer)
            outer.insert(place, v_outer)
        sch.reorder(*outer, *reduce, *inner)
        if outer:
            tile = at = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            if parallel:
                sch.parallel(tile)
            if reduce and _streams_weights(sch, block):
                # Its weight comes from memory every call at batch 1: prefetched ahead in
                # the reduction loop by a pass after lowering (:mod:`.prefetch`).
                sch.annotate(tile, STREAM, 1)
    epilogue = list(infos[index + 1 :])
    if reduce and tile is not None:
        # Accumulate the tile in registers, then write it back through the fused epilogue.
        writeback = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(writeback, at, preserve_unit_loops=True)
        epilogue = _fuse_epilogue(sch, writeback, epilogue)
        wb_loops = sch.get_loops(writeback)[depth:]
        if wb_loops and v_inner is not None:
            _vectorize(sch, wb_loops[-1], lanes)
            if len(wb_loops) > 1 and u_inner is not None:
                sch.unroll(wb_loops[-2])
    for pad in pads:
        sch.compute_at(pad.block_rv, tile, preserve_unit_loops=True)
        last = sch.get_loops(pad.block_rv)[-1]
        if (_extent(sch, last) or 1) % (2 * lanes) == 0:
            sch.vectorize(sch.split(last, [None, 2 * lanes])[1])
    separate = [p for p in separate if p not in pads]
    # Vectorize and unroll before decompose_reduction: afterwards the update block is no longer
    # a reduction block and vectorize refuses its loops.
    if v_inner is not None:
        _vectorize(sch, v_inner, lanes)
    if u_inner is not None:
        sch.unroll(u_inner)
    if reduce:
        sch.decompose_reduction(block, reduce[0])
    packed = None
    # A tile as wide as the output reads whole weight rows (nothing to pack), unless another
    # branch packed the weight, which then is the only form of it the kernel receives.
    if pack and reduce and fv is not None and (v_outer is not None or pack_width):
        width = pack_width if pack_width and fv % pack_width == 0 else fv
        packed = width if _pack_weights(sch, block, width) else None
    for other in separate + epilogue:
        _schedule_injective(sch, other.block_rv, lanes, parallel)
    return packed
