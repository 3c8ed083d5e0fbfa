"""Constant weights repacked into register-tile order, and two schedules of one kernel
chosen at run time (:class:`_Chosen`), which must then share one packed weight."""

from __future__ import annotations

from typing import Any

from enginekit.backends.tvm.simd import _same

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
