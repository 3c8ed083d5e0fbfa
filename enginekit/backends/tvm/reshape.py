"""Reshapes over symbolic dims, legalized axis group by axis group.

TVM 0.27 legalizes every ``reshape`` through one flat index: the output's indices are
raveled and unraveled into the input's, so a reshape over a symbolic sequence reads
``x[(b * seq + s) // seq, (b * seq + s) % seq, ...]``, a division by a symbolic value per
element that no simplifier removes. ``AnnotateTIROpPattern`` then calls the kernel opaque
(a load index uses ``seq``, which is no output index), so ``FuseOps`` fused nothing into it:
the small BERT of ``tvm_bench.py`` without static shapes kept every head reshape and
transpose a kernel of its own (59 kernel calls per inference where its static module made
34), each a pass over memory with those divisions per element.

Here the dims are matched in groups whose sizes are provably equal (``[b, s, 128]`` to
``[b, s, 4, 32]``: ``b``, ``s``, then ``128 = 4 x 32``), and each group is raveled and
unraveled on its own: the head split and merge divide by constants, a dim carried over is
read as it is, and the kernel is injective, so it fuses as the static module's does.
"""

from __future__ import annotations

from typing import Any

#: Dims either side a group may join before the match is given up.
_MAX_GROUP = 6


def _product(dims: Any) -> Any:
    from tvm import tirx

    total = tirx.const(1, "int64")
    for d in dims:
        total = total * d
    return total


def groups(src: Any, dst: Any) -> list[tuple[int, int, int, int]] | None:
    """Consecutive dims of ``src`` and ``dst`` in groups of provably equal size, smallest
    first: ``(src_start, src_end, dst_start, dst_end)`` each; None where none match."""
    from tvm import sym

    analyzer = sym.Analyzer()
    out: list[tuple[int, int, int, int]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        found = None
        for total in range(2, 2 * _MAX_GROUP + 1):
            for k in range(max(1, total - _MAX_GROUP), min(total, _MAX_GROUP + 1)):
                n = total - k
                if i + k > len(src) or j + n > len(dst):
                    continue
                if analyzer.can_prove_equal(_product(src[i : i + k]), _product(dst[j : j + n])):
                    found = (k, n)
                    break
            if found:
                break
        if found is None:
            return None
        out.append((i, i + found[0], j, j + found[1]))
        i, j = i + found[0], j + found[1]
    # Dims left on one side are ones (a trailing unit axis): they join the last group.
    rest = [*src[i:], *dst[j:]]
    if rest and (not out or not analyzer.can_prove_equal(_product(rest), 1)):
        return None
    if out:
        a, _, c, _ = out[-1]
        out[-1] = (a, len(src), c, len(dst))
    return out or None


def reshape(x: Any, shape: Any, matched: list[tuple[int, int, int, int]]) -> Any:
    """TE reshape of ``x`` to ``shape`` through the dim groups ``matched``."""
    from tvm import te, tirx

    src = list(x.shape)

    def element(*index: Any) -> Any:
        at = []
        for a, b, c, d in matched:
            # The group's output indices raveled, then unraveled into its input dims.
            flat = index[c]
            for k in range(c + 1, d):
                flat = flat * shape[k] + index[k]
            parts = []
            for dim in reversed(src[a + 1 : b]):
                parts.append(tirx.floormod(flat, dim))
                flat = tirx.floordiv(flat, dim)
            at += [flat, *reversed(parts)]
        return x[tuple(at)]

    return te.compute(shape, element, name="T_reshape")


def legalize_reshape(bb: Any, call: Any) -> Any:
    """``relax.reshape`` with a symbolic dim: by dim groups; any other: TVM's own."""
    import tvm
    from tvm import tirx

    src = call.args[0].ty.shape
    dst = call.ty.shape
    default = tvm.ir.Op.get("relax.reshape").get_attr("FLegalize")
    if src is None or dst is None or not hasattr(src, "values") or not hasattr(dst, "values"):
        return default(bb, call)
    src, dst = list(src.values), list(dst.values)
    if all(isinstance(d, tirx.IntImm) for d in [*src, *dst]):
        return default(bb, call)
    matched = groups(src, dst)
    if matched is None:
        return default(bb, call)
    return bb.call_te(reshape, call.args[0], dst, matched, primfunc_name_hint="reshape")
