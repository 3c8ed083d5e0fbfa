"""SIMD lanes of a CPU target and the register-tile sizes the default CPU schedule derives from
them (see :mod:`.schedule`): how many elements a vector step covers, how many rows a
register block holds, and how a tile's vector loop is split into whole vectors."""

from __future__ import annotations

from typing import Any

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


def _divides(sch: Any, loop: Any, factor: int) -> bool:
    """Whether ``factor`` provably divides the (symbolic) extent of ``loop``."""
    from tvm import sym, tirx

    expr = sch.get(loop).extent
    return bool(sym.Analyzer().can_prove_equal(tirx.floormod(expr, factor), 0))


def _same(a: Any, b: Any) -> bool:
    from tvm import tirx

    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return int(a) == int(b)
    return bool(a.same_as(b))


def _static(sch: Any, block: Any) -> bool:
    """Whether the block's output has no symbolic dim (a model exported with a fixed batch)."""
    from tvm import tirx

    return all(isinstance(d, tirx.IntImm) for d in sch.get(block).writes[0].source.shape)


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
    :func:`.schedule._pad_symbolic` the block it was padded to (provably divisible, so no
    predicate)."""
    extent = _extent(sch, loop)
    if extent is not None:
        return _block_factor(extent, lanes)

    factor = (_BLOCKS_WIDE if lanes >= 16 else _BLOCKS)[0]
    return factor if _divides(sch, loop, factor) else 1


def _block_factor(extent: int | None, lanes: int) -> int:
    if extent is None:
        return 1
    blocks = _BLOCKS_WIDE if lanes >= 16 else _BLOCKS
    return next((f for f in blocks if extent % f == 0), 1)


def _rows_block(lanes: int) -> int:
    return (_BLOCKS_WIDE if lanes >= 16 else _BLOCKS)[0]


#: Accumulators (float32) a static window conv's register tile may hold: TVM 0.27 allocates
#: a local buffer of 1 KiB or more (``kMaxStackAlloca``) with ``TVMBackendAllocWorkspace``,
#: a heap pointer LLVM cannot promote to registers (unless :mod:`.stack` keeps it on the
#: stack, as it now does for every tile).
STACK_FLOATS = 256


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
    their 8 rows. Since :mod:`.stack` keeps every tile of up to 2 KiB on the stack, 8 rows
    would be a stack array here too; measured no faster (the static demo CNN at batch 1,
    one thread: 0.985 of the 4-row build), so the limit stays."""
    if extent is None or block * width < STACK_FLOATS:
        return block
    blocks = _BLOCKS_WIDE if lanes >= 16 else _BLOCKS
    return next((f for f in blocks if f * width < STACK_FLOATS and extent % f == 0), block)


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
