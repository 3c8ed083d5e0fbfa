"""Where a reduction's loops go in the default CPU schedule (see :mod:`.schedule`): which
producers (paddings) are inlined, whether a large-window conv pads in a pass of its own,
whether short pixel rows are fused into one register block, and where the output-channel
tiles sit in the parallel loop of a weight-bound kernel."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from enginekit.backends.tvm.simd import _block_factor, _extent, _same


def _pads_inner_axis(sch: Any, block: Any) -> bool:
    """Whether an injective producer changes the size of the innermost axis (NCHW padding)."""
    stmt = sch.get(block)
    if len(stmt.reads) != 1 or len(stmt.writes) != 1:
        return True
    read = stmt.reads[0].source.shape
    write = stmt.writes[0].source.shape
    return len(read) != len(write) or not _same(read[-1], write[-1])


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


def _fuse_short_rows(sch: Any, outer: list[Any], lanes: int) -> None:
    """Fuse the last two pixel loops (rows and columns) in place when the columns alone are
    too few for a full register block: a 2x2 output (ResNet-50's last stage at 64x64
    inputs) was blocked by its 2 columns, 2 pixels x 2 vectors, 4 FMA chains where the FMA
    units' latency wants 8; fused, the 4 pixels make one block (1x1 convolutions there: 1.8x
    faster on one thread). For one reduction loop (a pointwise conv, a matmul), and for a
    window conv that streams a large weight (:func:`_streams_weights`: each weight strip is
    then read once, not once per row of pixels; ResNet-50's 2x2-pixel 3x3 convs, with the
    weight-stream prefetch, one thread: batch 1 0.89-0.93, batch 16 0.93-0.98 of the whole
    model's time before either change). Other window convs: their padding checks on the
    fused index measured no faster."""
    rows, cols = _extent(sch, outer[-2]), _extent(sch, outer[-1])
    if rows is None or cols is None:
        return
    fused = _block_factor(rows * cols, lanes)
    # Only when a block covers whole rows: the register tile's write-back region is inferred
    # per axis, so a block ending mid-row (3 columns, blocks of 2) would be widened to whole
    # rows and write back elements the tile never computed (wrong results on GRU and Resize).
    if _block_factor(cols, lanes) < fused and fused % cols == 0:
        outer[-2:] = [sch.fuse(outer[-2], outer[-1])]


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


#: Weight elements (float32: 4 MiB, four times a core's L2 here) from which a weight-bound
#: kernel's weight stream is prefetched ahead in its reduction loop; see
#: :func:`_streams_weights`. At 2^18 the demo CNN's 590K-element 3x3 convs were marked too
#: and it measured slower at batch 16 (one thread: 1.03 of before; ResNet-50 gained alike).
STREAM_WEIGHT = 1 << 20
#: The same threshold for a model whose constants do not fit in the last-level cache
#: (:func:`streamed_weights`): every weight then comes from memory every call, not only the
#: large ones, and ResNet-50 at 64x64 (102 MB of weights, L3 32 MiB) ran batch 1 in 0.87-0.89
#: of its time at 2^16 against 2^20 (layer2's and layer3's convs, 147K-590K elements, were at
#: 2.4x their roofline floor unprefetched), where the demo CNN (weights L3-sized) measured
#: 1.05-1.14x slower at 2^16: so the lower threshold only where the weights are evicted.
STREAM_WEIGHT_EVICTED = 1 << 16
_stream_weight: contextvars.ContextVar[int] = contextvars.ContextVar(
    "stream_weight", default=STREAM_WEIGHT
)


@contextlib.contextmanager
def streamed_weights(constant_bytes: int, cache_bytes: int | None) -> Iterator[int]:
    """Schedule the kernels under this block for a model of ``constant_bytes`` of constants on
    a host with a last-level cache of ``cache_bytes`` (None: unknown): the weight-stream
    threshold is :data:`STREAM_WEIGHT_EVICTED` when the constants exceed the cache, else
    :data:`STREAM_WEIGHT`. Yields the threshold in force."""
    evicted = cache_bytes is not None and constant_bytes > cache_bytes
    token = _stream_weight.set(STREAM_WEIGHT_EVICTED if evicted else STREAM_WEIGHT)
    try:
        yield _stream_weight.get()
    finally:
        _stream_weight.reset(token)


def _streams_weights(sch: Any, block: Any) -> bool:
    """Whether the block is weight-bound (:func:`_weight_bound`) with a weight of at least
    the threshold in force (:func:`streamed_weights`): at batch 1 it streams that weight from
    memory once per call, and its tile loop is marked for :func:`.prefetch.prefetch_streams`."""
    return _weight_bound(sch, block) and _weight_elements(sch, block) >= _stream_weight.get()


#: Register rows a single-pass tile (:func:`_single_pass_rows`) may hold: one vector of
#: accumulators per row plus the weight vector stay in AVX-512's 32 registers at 16 rows and in
#: AVX2's 16 at 12.
SINGLE_PASS_ROWS, SINGLE_PASS_ROWS_AVX2 = 16, 12
#: Lines of a tile's rows that may share one L1 set (4 KiB apart): 8, the ways of the smallest
#: common L1 (Zen 4's 32 KiB, 8-way; Zen 5's and Intel's 48 KiB are 12-way).
ALIASED_LINES = 8
#: Bytes between addresses that fall in the same L1 set (64 sets of 64-byte lines).
_SET_PERIOD = 4096


def _activation(sch: Any, block: Any) -> Any:
    """The block's activation read (leading dim the output's), or None; see
    :func:`_weight_bound`."""
    stmt = sch.get(block)
    out = stmt.writes[0].source
    for region in stmt.reads:
        buf = region.source
        if buf.same_as(out):
            continue
        if buf.shape and out.shape and _same(buf.shape[0], out.shape[0]) and len(buf.shape) > 1:
            return buf
    return None


def _single_pass_rows(sch: Any, block: Any, rows: Any, v_extent: int | None, lanes: int) -> int:
    """The register rows of a weight-streaming kernel's tile (:func:`_streams_weights`) that
    covers all of its pixel rows ``rows`` (a loop) in one vector of accumulators, or 0 where
    the default's tile stays.

    The default tile (8 rows x 2 vectors) splits ResNet-50's layer3 (4x4 = 16 pixels at 64x64
    inputs) in two, so each thread read its weight strip twice: once from memory, at memory
    speed, and once from L2, at compute speed, without overlap. A 16 x 1 tile reads each
    weight vector once for 16 FMAs: the stream and the FMAs overlap. Only where the rows'
    activation lines do not pile into one L1 set (:func:`_lines_per_set`): 16 pixels of
    1024 channels are 4 KiB apart, all in one set of an 8- or 12-way cache, and thrashed it
    (a chain of 1x1 1024 -> 256 -> 1024 convs: 16 x 1 measured 1.1x slower than 8 x 2 at
    1024 channels, 1.13x faster at 1008). ResNet-50 at batch 1 (two threads, medians of 21-25
    interleaved rounds, the VM's per-kernel times): layer3 0.92-0.94 ms against 1.04-1.05,
    its 3x3 convs and 256-channel-input 1x1 convs as 16 x 1; the whole model 0.79 of ONNX
    Runtime's latency against 0.85 in one interleaved run."""
    if not _streams_weights(sch, block) or v_extent is None or v_extent % lanes:
        return 0
    extent = _extent(sch, rows)
    top = SINGLE_PASS_ROWS if lanes >= 16 else SINGLE_PASS_ROWS_AVX2
    if extent is None or extent > top or extent <= _block_factor(extent, lanes):
        return 0
    if _lines_per_set(sch, block, extent) > ALIASED_LINES:
        return 0
    return extent


def _lines_per_set(sch: Any, block: Any, rows: int) -> int:
    """The most activation lines that ``rows`` pixels of an NHWC kernel's tile (row-major over
    its output's H x W) read at one reduction step and that fall in one L1 set (addresses a
    multiple of 4 KiB apart); the rows' count where the layout is not a static NHWC pair."""
    import tvm
    from tvm import tirx

    act = _activation(sch, block)
    out = sch.get(block).writes[0].source
    dims = [*act.shape[1:], *out.shape[1:]] if act is not None and len(act.shape) == 4 else []
    if len(dims) != 6 or not all(isinstance(d, tirx.IntImm) for d in dims):
        return rows
    h_in, w_in, channels, h_out, w_out, _ = (int(d) for d in dims)
    sh, sw = max(h_in // h_out, 1), max(w_in // w_out, 1)  # the conv's strides
    pitch = channels * tvm.DataType(str(act.dtype)).bits // 8
    sets = collections.Counter(
        ((p // w_out * sh * w_in + p % w_out * sw) * pitch // 64) % (_SET_PERIOD // 64)
        for p in range(rows)
    )
    return max(sets.values())
