"""Vectorizable erf and tanh on CPU: TVM's polynomial approximations instead of libm calls.

TVM 0.27 lowers ``erf`` on LLVM targets to a call of libm's ``erff`` per element: a vector
of 8 or 16 lanes becomes as many scalar calls (27.7 ns per element on Zen 3, where its own
polynomial ``fast_erf`` takes 0.45 ns). GELU is ``x * erf(x / sqrt 2)``, so every
transformer's feed-forward matmul spent twice as long in its epilogue as in the matmul
(small BERT at batch 16: 14 ms of 28 ms on one thread). ``tanh`` (GPT-2's GELU) goes
through ``exp`` the same way (10.2 ns vs 1.6 ns). The approximations are accurate to
4e-7 absolute over float32 (erf; tanh 3e-7, and relative near 0 better than the exp-based
form), well inside every fp32 verification tolerance.

Softmax gets ``fast_exp`` too (its exponentials cost more than the rest of the kernel), but
TVM's ``fast_exp`` clamps its argument, so ``exp(-inf)`` and NaN would not come out as 0 and
NaN, which masked softmax and its all-masked-row check rely on: :func:`_softmax` selects 0
and NaN at those inputs itself. Every other ``exp`` (sigmoid, SiLU) is left exact.
"""

from __future__ import annotations

from typing import Any

#: Relax ops replaced by a TE kernel built on TVM's approximations.
FAST = ("relax.erf", "relax.tanh", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.softmax")
#: Below this, TVM's ``fast_exp`` clamps its argument (``exp(-88.38)`` is float32's smallest
#: normal number): softmax takes 0 there, as ``exp`` does.
_EXP_FLOOR = -88.0
#: Running results per row of a reduction over a symbolic axis (:func:`_split_reduce`): two
#: AVX2 vectors, or one AVX-512 vector, of float32.
_PARTS = 16


def _softmax(x: Any, axis: int = -1) -> Any:
    """TOPI's softmax with ``fast_exp``, exact at the edges: ``x - max`` is 0 or below, and
    where it is below :data:`_EXP_FLOOR` (a masked position: -inf or float32's lowest) the
    exponential is 0, where it is NaN (a row masked entirely: ``-inf - -inf``) NaN, as with
    ``exp`` (the importer's all-masked-row check tests for that NaN)."""
    from tvm import te, tirx, topi

    shape = x.shape
    axis = axis % len(shape)
    k1 = te.reduce_axis((0, shape[axis]), name="k")
    k2 = te.reduce_axis((0, shape[axis]), name="k")
    reduced = tuple(d for i, d in enumerate(shape) if i != axis)

    def row(indices: Any) -> tuple[Any, ...]:
        return tuple(v for i, v in enumerate(indices) if i != axis)

    def at(indices: Any, k: Any) -> tuple[Any, ...]:
        return (*indices[:axis], k, *indices[axis:])

    if axis == len(shape) - 1 and not isinstance(shape[axis], tirx.IntImm):
        top = _split_reduce(reduced, shape[axis], lambda i, k: x[(*i, k)], te.max, "maxelem")
    else:
        top = te.compute(
            reduced, lambda *i: te.max(x[at(i, k1)], axis=k1), name="T_softmax_maxelem"
        )
    delta = te.compute(shape, lambda *i: x[i] - top[row(i)], name="T_softmax_delta")
    fast = topi.fast_exp(delta)
    exp = te.compute(
        shape,
        lambda *i: tirx.Select(
            delta[i] >= _EXP_FLOOR,
            fast[i],
            tirx.Select(tirx.isnan(delta[i]), delta[i], tirx.const(0, x.dtype)),
        ),
        name="T_softmax_exp",
    )
    if axis == len(shape) - 1 and not isinstance(shape[axis], tirx.IntImm):
        total = _split_reduce(reduced, shape[axis], lambda i, k: exp[(*i, k)], te.sum, "expsum")
    else:
        total = te.compute(
            reduced, lambda *i: te.sum(exp[at(i, k2)], axis=k2), name="T_softmax_expsum"
        )
    return te.compute(
        shape, lambda *i: exp[i] / total[row(i)], name="T_softmax_norm", attrs={"axis": axis}
    )


def _split_reduce(reduced: Any, n: Any, value: Any, op: Any, name: str) -> Any:
    """``op`` (``te.max``, ``te.sum``) of ``value(i, k)`` over ``k`` in ``[0, n)`` for each row
    ``i`` of ``reduced``, ``n`` symbolic: :data:`_PARTS` running results per row over the
    whole multiples of :data:`_PARTS` (a vector loop the schedule vectorizes), combined, then
    the tail of fewer than :data:`_PARTS` elements one by one, then both combined.

    Over one symbolic loop the reduction was a chain of dependent scalar adds (or max), one
    FP latency per element: a softmax over 2048 rows of 32 spent most of its time there.
    Each reduction runs one more step than it has elements, that step adding ``op``'s
    identity: a TIR reduction's init runs inside its first iteration, so a loop of none (a
    row shorter than :data:`_PARTS`, or no tail) would leave its result unset.
    """
    from tvm import te, tirx

    index = str(n.ty)
    parts = tirx.const(_PARTS, index)
    whole = tirx.floordiv(n, parts)
    main, rest = whole * parts, tirx.floormod(n, parts)
    none = tirx.const(0.0, "float32") if op is te.sum else tirx.min_value("float32")
    ko = te.reduce_axis((tirx.const(0, index), whole + 1), name="ko")
    part = te.compute(
        (*reduced, parts),
        lambda *i: op(
            tirx.if_then_else(ko < whole, value(i[:-1], ko * parts + i[-1]), none), axis=ko
        ),
        name=f"T_softmax_{name}_part",
    )
    kp = te.reduce_axis((tirx.const(0, index), parts), name="kp")
    head = te.compute(
        reduced, lambda *i: op(part[(*i, kp)], axis=kp), name=f"T_softmax_{name}_head"
    )
    kt = te.reduce_axis((tirx.const(0, index), rest + 1), name="kt")
    tail = te.compute(
        reduced,
        lambda *i: op(tirx.if_then_else(kt < rest, value(i, main + kt), none), axis=kt),
        name=f"T_softmax_{name}_tail",
    )
    both = tirx.max if op is te.max else tirx.Add
    return te.compute(reduced, lambda *i: both(head[i], tail[i]), name=f"T_softmax_{name}")


def _kernel(name: str) -> Any:
    """The TE computation replacing op ``name`` (the same formula as TVM's legalization,
    with ``fast_erf`` / ``fast_tanh`` in place of ``erf`` / ``tanh``)."""
    import math

    from tvm import topi

    def gelu(x: Any) -> Any:
        return x * (0.5 + topi.fast_erf(x * (1 / math.sqrt(2))) * 0.5)

    def gelu_tanh(x: Any) -> Any:
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + topi.fast_tanh(inner))

    return {
        "relax.nn.softmax": _softmax,
        "relax.erf": topi.fast_erf,
        "relax.tanh": topi.fast_tanh,
        "relax.nn.gelu": gelu,
        "relax.nn.gelu_tanh": gelu_tanh,
    }[name]


def fast_math(mod: Any) -> Any:
    """``mod`` with each float32 ``erf``, ``tanh``, GELU and softmax computed by TVM's vectorizable
    approximation (a TE kernel in place of the op; other dtypes are left as they are)."""
    from tvm import relax
    from tvm.relax import PyExprMutator, expr_functor

    @expr_functor.mutator
    class _Fast(PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            name = getattr(call.op, "name", None)
            if name not in FAST or len(call.args) != 1:
                return call
            if str(getattr(call.args[0].ty, "dtype", "")) != "float32":
                return call
            if name == "relax.nn.softmax":
                return self.builder_.call_te(_softmax, call.args[0], int(call.attrs.axis))
            return self.builder_.call_te(_kernel(name), call.args[0])

    if not any(_uses(func) for _gv, func in mod.functions_items()):
        return mod
    mutator = _Fast(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def _uses(func: Any) -> bool:
    """Whether a Relax function calls one of the ops in :data:`FAST`."""
    from tvm import relax

    if not isinstance(func, relax.Function):
        return False
    found = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: (
            found.append(e)
            if isinstance(e, relax.Call) and getattr(e.op, "name", None) in FAST
            else None
        ),
    )
    return bool(found)
