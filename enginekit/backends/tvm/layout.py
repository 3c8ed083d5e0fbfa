"""NHWC per region: TVM's ConvertLayout, with the ops it fails on made opaque layout barriers.

TVM 0.27's ``ConvertLayout`` is all-or-nothing: one op whose layout rule is broken aborts the
pass for the whole graph (a ``Squeeze`` with a negative axis dies with ``std::bad_alloc``).
Here a failing conversion is bisected to the op at fault; that op is lowered to its TIR
call (``call_tir``), which ConvertLayout does not look into, so the convolutions before and
after it still convert and the layout goes back to NCHW only at that op's edges (a transpose
in, one out). What was made opaque, and why, is returned as :class:`Barrier` records for the
manifest.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from enginekit.backends.tvm.messages import error_line
from enginekit.errors import BuildError

log = logging.getLogger(__name__)

#: ConvertLayout's layouts for conv2d. HWIO (not OHWI) weights: the output channel is
#: innermost, so the vectorized axis of the direct convolution reads weights contiguously
#: (OHWI measured 2x slower).
DESIRED = {"relax.nn.conv2d": ["NHWC", "HWIO"]}
#: At most this many barriers before giving up on NHWC (each costs ~log2(ops) conversions).
MAX_BARRIERS = 8


@dataclasses.dataclass(frozen=True)
class Barrier:
    """One op kept in the model's own layout because ConvertLayout failed on it.

    Attributes:
        op: the Relax op (``relax.squeeze``).
        var: the Relax variable it binds (the importer names them; with its shape).
        why: the first informative line of ConvertLayout's error when the op was converted.
    """

    op: str
    var: str
    why: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def positive_axes(mod: Any) -> Any:
    """``squeeze`` axes made non-negative (``axis=[-1]`` of a rank-4 tensor is ``[3]``).

    ConvertLayout's rule for squeeze indexes the layout with the axis as given: a negative
    one dies with ``std::bad_alloc`` and took NHWC from the whole model (a conv followed by
    ``x.squeeze(-1)``). The rank is known wherever the axis matters.
    """
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class Positive(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.squeeze"):
                return call
            axes = call.attrs.axis
            ty = getattr(call.args[0], "ty", None)
            ndim = getattr(ty, "ndim", -1)
            if axes is None or ndim < 0 or all(int(a) >= 0 for a in axes):
                return call
            return relax.op.squeeze(call.args[0], [int(a) % ndim for a in axes])

    return _each_function(mod, lambda f: Positive().visit_expr(f))


def _each_function(mod: Any, rewrite: Any) -> Any:
    from tvm import relax

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite(func)
    return mod


def _candidates(mod: Any) -> list[tuple[str, int, str, str]]:
    """(function, binding index, op, var) of every op call that can be made opaque, in
    program order: dataflow bindings of a registered op that has a legalization."""
    import tvm
    from tvm import relax

    out = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        index = 0
        for block in func.body.blocks:
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
                    continue
                name = value.op.name
                if not _opaque_able(binding, name):
                    continue
                var = binding.var.name
                shape = getattr(binding.var.ty, "shape", None)
                label = f"{var}: {_dims(shape)}" if shape is not None else var
                out.append((gv.name_hint, index, name, label))
                index += 1
    return out


def _dims(shape: Any) -> str:
    """``(batch, 4, 8)``: a Relax shape the way users write it."""
    from tvm import tirx

    dims = [str(int(d)) if isinstance(d, tirx.IntImm) else str(d) for d in shape]
    return f"({', '.join(dims)})"


def _opaque_able(binding: Any, name: str) -> bool:
    import tvm
    from tvm import relax

    if name in DESIRED or not isinstance(binding.var, relax.DataflowVar):
        return False
    return tvm.ir.Op.get(name).get_attr("FLegalize") is not None


def with_barriers(mod: Any, picked: set[tuple[str, int]]) -> Any:
    """A copy of ``mod`` where the calls in ``picked`` (function, index in
    :func:`_candidates` order) are replaced by their legalized ``call_tir`` form."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class Opaque(relax.PyExprMutator):
        def __init__(self, module: Any, function: str) -> None:
            super().__init__(module)
            self.function = function
            self.index = 0

        def visit_var_binding_(self, binding: Any) -> None:
            value = binding.value
            if (
                isinstance(value, relax.Call)
                and isinstance(value.op, tvm.ir.Op)
                and _opaque_able(binding, value.op.name)
            ):
                index = self.index
                self.index += 1
                if (self.function, index) in picked:
                    call = self.visit_expr(value)
                    legalize = tvm.ir.Op.get(value.op.name).get_attr("FLegalize")
                    lowered = legalize(self.builder_, call)
                    var = self.builder_.emit(lowered, name_hint=binding.var.name)
                    self.set_var_remap(binding.var, var)
                    return
            super().visit_var_binding_(binding)

    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and any(f == gv.name_hint for f, _ in picked):
            mutator = Opaque(out, gv.name_hint)
            new = mutator.visit_expr(func)
            out = mutator.builder_.get()
            out[gv] = new
    return out


def _convert(mod: Any) -> Any:
    from tvm import relax

    return relax.transform.ConvertLayout(DESIRED)(mod)


def convert_nhwc(mod: Any) -> tuple[Any, list[Barrier]]:
    """``mod`` with conv2d in NHWC/HWIO wherever ConvertLayout succeeds.

    Returns:
        the converted module and the ops made opaque to get there (empty when the whole
        graph converted).

    Raises:
        BuildError: not even with every other op opaque does conv2d convert, or more than
            :data:`MAX_BARRIERS` ops fail (the caller then builds the model's own layout).
    """
    mod = positive_axes(mod)
    try:
        return _convert(mod), []
    except Exception as exc:
        first = error_line(exc) or type(exc).__name__
    candidates = _candidates(mod)
    keys = [(f, i) for f, i, _, _ in candidates]
    barriers: list[Barrier] = []
    chosen: set[tuple[str, int]] = set()
    base = 0  # every candidate before ``base`` is decided (converted, or chosen)
    why = first

    def attempt(opaque_from: int) -> tuple[Any, str]:
        try:
            return _convert(with_barriers(mod, chosen | set(keys[opaque_from:]))), ""
        except Exception as exc:
            return None, error_line(exc) or type(exc).__name__

    converted, err = attempt(base)
    if converted is None:
        raise BuildError(
            f"TVM's ConvertLayout to NHWC failed on this model ({first}), even with every "
            f"op but conv2d kept in NCHW ({err}); build with layout='NCHW'"
        )
    while True:
        # Largest ``lo`` with the candidates from ``lo`` on opaque converting; the one at
        # ``lo`` is then at fault (converting it too fails).
        lo, hi = base, len(keys)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            result, err = attempt(mid)
            if result is not None:
                lo = mid
            else:
                hi, why = mid, err
        _, _, op, var = candidates[lo]
        chosen.add(keys[lo])
        barriers.append(Barrier(op, var, why))
        log.info("tvm layout: %s (%s) kept NCHW: %s", op, var, why)
        base = lo + 1
        converted, why = attempt(len(keys))
        if converted is not None:
            return converted, barriers
        if len(barriers) >= MAX_BARRIERS or base >= len(keys):
            raise BuildError(
                f"TVM's ConvertLayout to NHWC failed on this model ({first}); "
                f"{len(barriers)} ops kept NCHW were not enough ({why}); "
                "build with layout='NCHW'"
            )
