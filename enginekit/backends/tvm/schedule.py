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
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Register-block sizes tried for the second-innermost output axis, best first. The tile is
#: ``block x 2 vectors`` accumulators: AVX-512's 32 registers hold 8 x 2 (a ResNet-style CNN
#: measured 1.1-2.2x faster than with 4 x 2 on Zen 4, batch 1 and 16); AVX2's 16 hold 4 x 2.
_BLOCKS = (4, 3, 2)
_BLOCKS_WIDE = (8, 6, 4, 3, 2)


def vector_lanes(target: Any, dtype_bits: int = 32) -> int:
    """SIMD lanes for ``dtype_bits`` elements on an LLVM target (from its CPU features).

    ``llvm_get_vector_width`` reports 512 bits even for AVX2-only CPUs in TVM 0.27, so the
    width is read from the target's feature list instead.
    """
    from tvm.target import codegen

    try:
        features = set(codegen.llvm_get_cpu_features(target))
    except Exception:  # a target LLVM cannot describe (another architecture's triple)
        features = set()
    if "avx512f" in features:
        bits = 512
    elif "avx" in features or "avx2" in features:
        bits = 256
    else:
        bits = 128
    return max(bits // dtype_bits, 2)


def _extent(sch: Any, loop: Any) -> int | None:
    from tvm import tirx

    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _vector_factor(extent: int | None, lanes: int) -> int | None:
    """How many elements of the innermost output axis one vector step covers."""
    if extent is None:
        return None
    for f in (2 * lanes, lanes):
        if extent % f == 0:
            return f
    if lanes >= 16:
        # AVX-512: whole 256-bit vectors where 512-bit ones do not divide the axis (24, 72,
        # 88 channels of MobileNetV3): the fallbacks were one <24 x float> vector, or 11 and
        # 12 lanes (88 = 8 x 11), which LLVM legalizes as a 512-bit and a partial vector.
        half = lanes // 2
        for f in (3 * half, half):
            if extent % f == 0:
                return f
    if extent <= 2 * lanes:
        return extent
    for f in range(lanes, 3, -1):
        if extent % f == 0:
            return f
    return None


#: Vectors of accumulators in a tile without a register-blocked row, widest first. Such a
#: tile (a batch-1 matmul) streams its weight columns at the weight's row stride; 8 vectors
#: read 4 cache lines per row where 4 read 2: MobileNetV3's 576x1024 classifier layer ran
#: 1.75x faster at 8 (AVX2, one thread; 8 accumulators still fit the 16 registers).
_WIDE = (8, 6, 5, 4, 3)


def _wide_vector_factor(extent: int | None, lanes: int, multiple: int | None = None) -> int | None:
    """A wide tile of whole vectors; on AVX-512, of half vectors (256 bits) where no whole
    ones fit: a 1000-class classifier's 1000 columns are no multiple of 16, and the
    fallback was one ``<10 x float>`` vector, a single FMA chain (2048x1000 alone, one
    thread: 333 -> 155 us; MobileNetV3's 1024x1000 in the model: 0.9 -> 0.55 ms).

    With ``multiple`` (the tile width another schedule of the kernel packed the weight in),
    only a multiple of it, or ``multiple`` itself where none fits: both then read one
    packed weight."""
    if extent is None:
        return None
    for width in _widths(lanes):
        factor = next(
            (
                k * width
                for k in _WIDE
                if extent % (k * width) == 0 and (k * width) % (multiple or 1) == 0
            ),
            None,
        )
        if factor is not None:
            return factor
    return multiple


def _widths(lanes: int) -> tuple[int, ...]:
    """Vector widths a tile may be made of: the target's, and half of it on AVX-512."""
    return (lanes, lanes // 2) if lanes >= 16 else (lanes,)


def _row_factor(sch: Any, loop: Any, lanes: int) -> int:
    """The register block for ``loop``: from its extent, or for a symbolic extent padded by
    :func:`_pad_symbolic` the block it was padded to (provably divisible, so no predicate)."""
    extent = _extent(sch, loop)
    if extent is not None:
        return _block_factor(extent, lanes)

    factor = (_BLOCKS_WIDE if lanes >= 16 else _BLOCKS)[0]
    return factor if _divides(sch, loop, factor) else 1


def _divides(sch: Any, loop: Any, factor: int) -> bool:
    """Whether ``factor`` provably divides the (symbolic) extent of ``loop``."""
    from tvm import sym, tirx

    expr = sch.get(loop).extent
    return bool(sym.Analyzer().can_prove_equal(tirx.floormod(expr, factor), 0))


def _block_factor(extent: int | None, lanes: int) -> int:
    if extent is None:
        return 1
    blocks = _BLOCKS_WIDE if lanes >= 16 else _BLOCKS
    return next((f for f in blocks if extent % f == 0), 1)


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


def _pads_inner_axis(sch: Any, block: Any) -> bool:
    """Whether an injective producer changes the size of the innermost axis (NCHW padding)."""
    stmt = sch.get(block)
    if len(stmt.reads) != 1 or len(stmt.writes) != 1:
        return True
    read = stmt.reads[0].source.shape
    write = stmt.writes[0].source.shape
    return len(read) != len(write) or not _same(read[-1], write[-1])


def _same(a: Any, b: Any) -> bool:
    from tvm import tirx

    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return int(a) == int(b)
    return bool(a.same_as(b))


def _vectorize(sch: Any, loop: Any, lanes: int) -> None:
    """Vectorize ``loop``; a tile wider than two vectors (the wide GEMV tiles, 3-8 vectors),
    or on AVX-512 one of half vectors (24 channels), is split into an unrolled loop of
    one-vector steps. LLVM legalizes a ``<40 x float>`` vector badly: a batch-1 matmul
    1024x1000 (MobileNetV3's classifier) measured 2x slower than with five unrolled 8-lane
    steps (AVX2, one thread); MobileNetV3 with its 24- and 72-channel convs as
    ``<24 x float>`` vectors ran 1.5x slower than with three 8-lane steps (Zen 4, one
    thread, batch 16: 8.4 against 5.5 ms, one loaded run)."""
    extent = _extent(sch, loop)
    width = next((w for w in _widths(lanes) if extent and extent % w == 0), None)
    if (
        extent is None
        or width is None
        or extent == width
        or (extent <= 2 * lanes and width == lanes)
    ):
        sch.vectorize(loop)
        return
    steps, vec = sch.split(loop, [None, width])
    sch.vectorize(vec)
    sch.unroll(steps)


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


def _elements(buffer: Any) -> int:
    """Elements of a buffer, its symbolic dims (the batch) counted as 1."""
    from tvm import tirx

    n = 1
    for dim in buffer.shape:
        n *= int(dim) if isinstance(dim, tirx.IntImm) else 1
    return n


def _weight_bound(sch: Any, block: Any) -> bool:
    """Whether the block reads more weight than activation (at batch 1), so that its
    output-channel tiles should sit outside its pixel (or row) tiles in the parallel loop:
    each thread then streams its share of the weight once, each strip reused by every pixel
    tile while in cache, instead of the whole weight once per pixel tile.

    The activation is the read whose leading dim is the output's (the batch); any other
    read is a weight. Reads of the accumulator itself are skipped.
    """
    stmt = sch.get(block)
    out = stmt.writes[0].source
    activation = weight = 0
    for region in stmt.reads:
        buf = region.source
        if buf.same_as(out):
            continue
        if buf.shape and out.shape and _same(buf.shape[0], out.shape[0]) and len(buf.shape) > 1:
            activation = max(activation, _elements(buf))
        else:
            weight = max(weight, _elements(buf))
    return weight > activation


def _channel_tiles_at(sch: Any, block: Any, outer: list[Any], spatial: int) -> int:
    """Where the output-channel tile loop goes among the ``outer`` (pixel) loops.

    Innermost by default: consecutive tiles share their input pixels. A weight-bound matmul
    puts it outermost (see :func:`_weight_bound`). A weight-bound convolution (ResNet-50's
    last stages at small inputs: 2x2 pixels, 9 MB of weights) puts it right after the batch
    loop: with it innermost every row of pixel tiles streamed the whole weight again, and at
    batch 1 the two threads each streamed all of it (a weight-outermost loop also spans the
    batch: late MobileNetV3 convs measured 1.2-1.8x slower at batch 16) -- except where the
    weight is larger than :data:`LARGE_WEIGHT`: then every image re-read it from memory
    (ResNet-50's last 3x3 convs, 9 MB, batch 16, one thread: 0.78-0.89 of the time with the
    channel tiles outermost, each thread's share read once for the whole batch). ``spatial`` is the
    block's count of spatial loops: one fewer than the output's rank when a batch of 1 was
    normalized away, and then there is no batch loop to stay outside.
    """
    if not _weight_bound(sch, block):
        return len(outer)
    rank = len(sch.get(block).writes[0].source.shape)
    if rank <= 3 or spatial < rank or _weight_elements(sch, block) > LARGE_WEIGHT:
        return 0
    return min(1, len(outer))


#: Weight elements (float32: 4 MiB, several times a core's L2) above which a weight-bound
#: convolution puts its output-channel tiles outside the batch loop too; see
#: :func:`_channel_tiles_at`.
LARGE_WEIGHT = 1 << 20


def _weight_elements(sch: Any, block: Any) -> int:
    """Elements of the largest read that is not the activation (see :func:`_weight_bound`)."""
    stmt = sch.get(block)
    out = stmt.writes[0].source
    sizes = [
        _elements(r.source)
        for r in stmt.reads
        if not r.source.same_as(out)
        and not (r.source.shape and out.shape and _same(r.source.shape[0], out.shape[0]))
    ]
    return max(sizes, default=0)


def _fuse_short_rows(sch: Any, outer: list[Any], lanes: int) -> None:
    """Fuse the last two pixel loops (rows and columns) in place when the columns alone are
    too few for a full register block: a 2x2 output (ResNet-50's last stage at 64x64
    inputs) was blocked by its 2 columns, 2 pixels x 2 vectors, 4 FMA chains where the FMA
    units' latency wants 8; fused, the 4 pixels make one block (1x1 convolutions there: 1.8x
    faster on one thread). Only for one reduction loop (a pointwise conv, a matmul): a 3x3
    window's padding checks on the fused index measured no faster."""
    rows, cols = _extent(sch, outer[-2]), _extent(sch, outer[-1])
    if rows is None or cols is None:
        return
    fused = _block_factor(rows * cols, lanes)
    # Only when a block covers whole rows: the register tile's write-back region is inferred
    # per axis, so a block ending mid-row (3 columns, blocks of 2) would be widened to whole
    # rows and write back elements the tile never computed (wrong results on GRU and Resize).
    if _block_factor(cols, lanes) < fused and fused % cols == 0:
        outer[-2:] = [sch.fuse(outer[-2], outer[-1])]


#: Annotation of a block that only repacks a weight: TVM's ``SplitLayoutRewritePreproc``
#: moves such a block into a function of its own, which ``FoldConstant`` runs at build time.
PREPACK = "meta_schedule.layout_rewrite_preproc"


def _layout_free(sch: Any) -> list[Any]:
    """The function's parameters that Relax binds to constants (``layout_free_buffers``,
    attached by ``AttachAttrLayoutFreeBuffers``): weights whose layout the schedule may change,
    since the repacking is folded at build time."""
    func = sch.mod["main"]
    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    return [func.params[int(i)] for i in free] if free else []


def _pack_weights(sch: Any, block: Any, width: int) -> int:
    """Repack each constant weight the block reads along the output's innermost axis into
    tiles of ``width`` (``[..., K, N]`` -> ``[N / width, ..., K, width]``); returns how many.

    A register tile reads ``width`` contiguous weights per reduction step; in the model's layout
    (HWIO, a matmul's ``K x N``) consecutive steps are a row (``N`` floats) apart, so a tile's
    weights span a page every few steps and the prefetcher cannot follow: ResNet-50's 3x3
    convs over 2x2 pixels ran at 13-16 GF/s on one thread. Packed, each tile's weights are one
    contiguous stream. The repacking is a separate block that the build folds into a new
    constant (:data:`PREPACK`), so it never runs per call.
    """
    from tvm import tirx

    free = _layout_free(sch)
    if not free:
        return 0
    stmt = sch.get(block)
    out = stmt.writes[0]
    last = out.region[-1].min
    packed = 0
    for index, region in enumerate(stmt.reads):
        buf = region.source
        shape = buf.shape
        if not any(buf.same_as(p) for p in free) or len(shape) < 2:
            continue
        n = shape[-1]
        if not isinstance(n, tirx.IntImm) or int(n) % width or int(n) == width:
            continue
        if not (
            isinstance(region.region[-1].min, tirx.Var) and region.region[-1].min.same_as(last)
        ):
            continue  # the weight's last axis is not the output's vector axis
        cache = sch.cache_read(block, index, "global")
        sch.transform_layout(
            block, ("read", index), lambda *ax: (ax[-1] // width, *ax[:-1], ax[-1] % width)
        )
        sch.annotate(cache, PREPACK, True)
        packed += 1
    return packed


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


def _schedule_reduction(
    sch: Any,
    infos: list[Any],
    index: int,
    lanes: int,
    parallel: bool = True,
    pack: bool = True,
    padded: bool = False,
    pack_width: int | None = None,
) -> int | None:
    """Schedule the reduction ``infos[index]`` (see the module docstring); returns the width
    of the tiles its constant weights were repacked into, None where none was. With
    ``pack_width`` the weights are packed in tiles of that width where it divides the
    register tile's (another schedule of the kernel, chosen at run time, reads the same
    packed weight: one constant instead of one per schedule)."""
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
    if len(reduce) == 1 and fv is not None and len(outer) >= 2:
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
    if reduce and outer and fv is not None:
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
            outer.insert(_channel_tiles_at(sch, block, outer, len(spatial)), v_outer)
        sch.reorder(*outer, *reduce, *inner)
        if outer:
            tile = at = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            if parallel:
                sch.parallel(tile)
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


#: Accumulators (float32) a register tile may hold and still be a stack array: TVM 0.27
#: allocates a local buffer of 1 KiB or more (``kMaxStackAlloca``) with
#: ``TVMBackendAllocWorkspace``, a heap pointer LLVM cannot promote to registers.
STACK_FLOATS = 256


def _static(sch: Any, block: Any) -> bool:
    """Whether the block's output has no symbolic dim (a model exported with a fixed batch)."""
    from tvm import tirx

    return all(isinstance(d, tirx.IntImm) for d in sch.get(block).writes[0].source.shape)


def _stack_block(extent: int | None, block: int, width: int, lanes: int) -> int:
    """The register block of a static window conv (several reduction loops: a 3x3 conv's
    padding checks inlined in its update) shrunk until ``block x width`` accumulators stay
    under :data:`STACK_FLOATS`. AVX-512's 8 x 32 tile is exactly 1 KiB: its accumulators
    live in a workspace buffer, and where the padding checks' branches keep LLVM from
    hoisting their stores out of the reduction loop, every step stores all 16 vectors. With
    a static batch they did: the demo CNN exported with batch 1 ran its 3x3 convs at 40
    instead of 100 GF/s, the model 2.35x slower than built with a symbolic batch (one
    thread, CPU time). Over a symbolic batch the stores were hoisted in every conv of the
    demo CNN and ResNet-50, and 4-row tiles there measured 8% slower at batch 1: those keep
    their 8 rows."""
    if extent is None or block * width < STACK_FLOATS:
        return block
    blocks = _BLOCKS_WIDE if lanes >= 16 else _BLOCKS
    return next((f for f in blocks if f * width < STACK_FLOATS and extent % f == 0), block)


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


#: Window taps (kernel height x width) from which a conv over fewer input channels than a
#: vector's lanes pads its input in a pass of its own; see :func:`_narrow_window`.
WIDE_WINDOW = 49


def _narrow_window(sch: Any, info: Any, lanes: int) -> bool:
    """Whether ``info`` is a large-window conv over fewer input channels than a vector's lanes
    (a 7x7 stem over RGB): its padding then goes in a pass of its own. Inlined, each of the
    49 taps was a bounds check for 3 multiply-adds per output vector: ResNet-50's stem alone
    (7x7, stride 2, 3 -> 64 channels, 64x64), one thread, best of 9: 0.46 -> 0.27 ms at batch
    1, 8.1 -> 5.2 ms at 16. Smaller windows measured no faster (5x5, 3x3) or slower (a 3x3
    stride-2 stem: 0.033 -> 0.049 ms)."""
    loops = sch.get_loops(info.block_rv)
    extents = [_extent(sch, lp) for lp, k in zip(loops, info.dom_kind()) if k == "R"]
    reduce = [e for e in extents if e is not None]
    if len(reduce) < 3 or len(reduce) < len(extents):
        return False
    *window, channels = reduce
    taps = 1
    for e in window:
        taps *= e
    return channels < lanes and taps >= WIDE_WINDOW


def _rows_block(lanes: int) -> int:
    return (_BLOCKS_WIDE if lanes >= 16 else _BLOCKS)[0]


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


def _sequence_rows(sch: Any, info: Any) -> bool:
    """Whether a reduction's (symbolic) row axis has another spatial axis outside it, as a
    sequence inside a batch (``[batch, seq, K] @ [K, N]``), rather than being the batch."""
    kinds = info.dom_kind()
    return sum(k == "S" for k in kinds) >= 3


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


def _union(first: Any, second: Any) -> list[Any]:
    """Both lists of buffers, each once: a buffer neither schedule changed (a conv's padded
    input) is the same object in both, and TVM refuses a buffer allocated twice."""
    out = list(first)
    out += [b for b in second if not any(b.same_as(a) for a in out)]
    return out


def _prepacks(body: Any) -> tuple[list[Any], Any]:
    """(the weight repackings at the top of a root block's ``body``, the rest of it)."""
    from tvm import s_tir, tirx

    def repacks(stmt: Any) -> bool:
        while isinstance(stmt, tirx.For):
            stmt = stmt.body
        return isinstance(stmt, s_tir.SBlockRealize) and PREPACK in stmt.block.annotations

    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    packs = [st for st in stmts if repacks(st)]
    rest = [st for st in stmts if not repacks(st)]
    return packs, tirx.SeqStmt(rest) if len(rest) > 1 else rest[0]


class _PackConflict(ValueError):
    """Two schedules of a kernel, chosen at run time, repack one weight in two layouts (TVM
    splits out one repacking per weight parameter)."""


def _packs(stmt: Any) -> tuple[Any, Any]:
    """(the weight a repacking loop nest reads, the packed buffer it writes)."""
    from tvm import tirx

    while isinstance(stmt, tirx.For):
        stmt = stmt.body
    block = stmt.block
    return block.reads[0].source, block.writes[0].source


def _shared_packs(first: list[Any], second: list[Any]) -> tuple[list[Any], list[Any]]:
    """([(second's packed buffer, first's) for each weight both pack to one shape], the
    repackings of ``second`` left)."""
    same, left = [], []
    for stmt in second:
        weight, packed = _packs(stmt)
        match = next(
            (q for w, q in map(_packs, first) if w.same_as(weight) and _same_shape(q, packed)),
            None,
        )
        if match is None:
            left.append(stmt)
        else:
            same.append((packed, match))
    return same, left


def _same_shape(a: Any, b: Any) -> bool:
    return len(a.shape) == len(b.shape) and all(_same(x, y) for x, y in zip(a.shape, b.shape))


class _Chosen:
    """Two schedules of one kernel as one function: ``if cond: first else: second``.

    Has the ``mod`` that ``dlight.ApplyDefaultSchedule`` reads from a rule's result; no
    trace (MetaSchedule tunes static shapes, where no choice is made).
    """

    def __init__(self, first: Any, second: Any, cond: Any) -> None:
        import tvm
        import tvm_ffi
        from tvm import s_tir, tirx

        a, b = first.mod["main"], second.mod["main"]
        # TVM's lowering wants the function body to be one root block: the two roots' bodies
        # become the branches, their allocations the new root's. Weight repackings go before
        # the branch, at the top level, where SplitLayoutRewritePreproc finds them.
        ra, rb = a.body.block, b.body.block
        packs_a, body_a = _prepacks(ra.body)
        packs_b, body_b = _prepacks(rb.body)
        # One repacking per weight: TVM's split moves each into a function taking the weight
        # parameter (which then is the packed weight), and refuses a parameter repacked
        # twice. So both branches must pack the same weights alike, and the second reads
        # the first's packed buffers.
        same, left = _shared_packs(packs_a, packs_b)
        if left or len(same) != len(packs_a):
            raise _PackConflict("the two schedules repack their weights differently")
        if same:
            body_b = tvm_ffi.structural_map(
                body_b, [(tvm.ir.Var, lambda v: next((n for o, n in same if o.same_as(v)), v))]
            )
        dropped = [o for o, _ in same]
        allocs = [x for x in _union(ra.alloc_buffers, rb.alloc_buffers)
                  if not any(x.same_as(o) for o in dropped)]  # fmt: skip
        stmts = [*packs_a, tirx.IfThenElse(cond, body_a, body_b)]
        root = s_tir.SBlock(
            [], [], [], "root", tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0],
            alloc_buffers=allocs,
        )  # fmt: skip
        body = s_tir.SBlockRealize([], True, root)
        self.mod = tvm.IRModule({"main": b.with_body(body)})


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


def schedule_cpu(func: Any, lanes: int, choices: bool = True) -> Any:
    """A schedule for ``func`` (a TIR PrimFunc), or None where the rule does not apply.

    Small kernels (below :data:`PARALLEL_WORK`) get serial loops; one whose size depends on a
    symbolic dim (the batch) and may fall either side gets both schedules, chosen at run time.
    """
    try:
        return _schedule_cpu(func, lanes, choices, pack=True)
    except _PackConflict:  # schedules chosen at run time that want two layouts of a weight
        return _schedule_cpu(func, lanes, choices, pack=False)


def _schedule_cpu(func: Any, lanes: int, choices: bool, pack: bool) -> Any:
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
        return _schedule(func, lanes, parallel, choices, pack)
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
    func: Any, lanes: int, parallel: bool, choices: bool = True, pack: bool = True
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
        _schedule_reduction(sch, infos, reductions[0], lanes, parallel, pack)
        return sch
    if _extent(sch, sch.get_loops(infos[-1].block_rv)[-1]) is None:
        return _schedule_rows(sch, lanes, parallel)
    return None  # softmax, layer norm over a static axis: DLight's Reduction rule


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


def cpu_rules(target: Any, choices: bool = True) -> list[Any]:
    """Schedule rules for ``dlight.ApplyDefaultSchedule`` on an LLVM target, best first
    (``choices=False``: one schedule per kernel, none chosen at run time)."""
    from tvm import tirx
    from tvm.s_tir import dlight

    lanes = vector_lanes(target)

    class EnginekitCPU(dlight.ScheduleRule):
        """enginekit's tiled, parallel, vectorized CPU schedule (see the module docstring)."""

        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc):
                return None
            try:
                sch = schedule_cpu(func, lanes, choices)
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
