"""ONNX's recurrent ops (RNN, GRU, LSTM) as enginekit's converters for TVM 0.27's Relax
importer, which has none ("cannot convert op 'LSTM'").

The recurrence is unrolled over the sequence, so the sequence length must be static (a
symbolic one is a BuildError naming op and node). The input projection ``X W^T + Wb`` is one
matmul for every step; only the recurrent part is per step. ``sequence_lens`` is honoured as the
spec's reference does: a step at or past a sequence's length keeps its state and outputs zeros.
Run in reverse order with that mask, the reverse direction sees each sequence reversed within
its own length, with no gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from enginekit.errors import BuildError

#: Activations whose parameters come from ``activation_alpha`` / ``activation_beta``, in order.
_TAKES_ALPHA = {"leakyrelu", "thresholdedrelu", "elu", "hardsigmoid", "affine", "scaledtanh"}
_TAKES_BETA = {"hardsigmoid", "affine", "scaledtanh"}
#: Per op: number of gates, default activations (per direction).
_GATES = {
    "RNN": (1, ["Tanh"]),
    "GRU": (3, ["Sigmoid", "Tanh"]),
    "LSTM": (4, ["Sigmoid", "Tanh", "Tanh"]),
}
_DIRECTIONS = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}

Act = Callable[[Any], Any]


def converters() -> dict[str, Any]:
    """Converters for RNN, GRU and LSTM (every opset: the attributes are a superset)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    def make(op: str) -> Any:
        def impl(cls: Any, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _recurrent(bb, op, list(inputs), attr)

        doc = f"ONNX {op}, unrolled over a static sequence length (see enginekit.backends.tvm.rnn)."
        return type(
            op, (onnx_frontend.OnnxOpConverter,), {"__doc__": doc, "_impl_v1": classmethod(impl)}
        )

    return {op: make(op) for op in _GATES}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _activation(name: str, alpha: float | None, beta: float | None, dtype: str, node: str) -> Act:
    from tvm import relax

    def c(v: float) -> Any:
        return relax.const(v, dtype)

    key = name.lower()
    simple = {"tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid, "relu": relax.op.nn.relu}
    if key in simple:
        return simple[key]
    if key == "softsign":
        return lambda x: relax.op.divide(x, relax.op.add(c(1.0), relax.op.abs(x)))
    if key == "softplus":
        return lambda x: relax.op.log(relax.op.add(c(1.0), relax.op.exp(x)))
    if key == "leakyrelu":
        a = 0.01 if alpha is None else alpha
        return lambda x: relax.op.where(
            relax.op.greater_equal(x, c(0.0)), x, relax.op.multiply(x, c(a))
        )
    if key == "thresholdedrelu":
        t = 1.0 if alpha is None else alpha
        return lambda x: relax.op.where(relax.op.greater(x, c(t)), x, c(0.0))
    if key == "elu":
        e = 1.0 if alpha is None else alpha
        return lambda x: relax.op.where(
            relax.op.greater_equal(x, c(0.0)),
            x,
            relax.op.multiply(c(e), relax.op.subtract(relax.op.exp(x), c(1.0))),
        )
    if key == "hardsigmoid":
        ha, hb = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: relax.op.minimum(
            relax.op.maximum(relax.op.add(relax.op.multiply(x, c(ha)), c(hb)), c(0.0)), c(1.0)
        )
    if key == "affine":
        fa, fb = (1.0 if alpha is None else alpha), (0.0 if beta is None else beta)
        return lambda x: relax.op.add(relax.op.multiply(x, c(fa)), c(fb))
    if key == "scaledtanh":
        sa, sb = (1.0 if alpha is None else alpha), (1.0 if beta is None else beta)
        return lambda x: relax.op.multiply(c(sa), relax.op.tanh(relax.op.multiply(x, c(sb))))
    raise BuildError(
        f"TVM: recurrent activation {name!r} at node {node!r} is not one ONNX defines "
        "(Tanh, Sigmoid, Relu, LeakyRelu, ThresholdedRelu, Elu, HardSigmoid, Affine, "
        "ScaledTanh, Softsign, Softplus); fix the model"
    )


def _activations(
    op: str, attr: dict[str, Any], dirs: int, dtype: str, node: str
) -> list[list[Act]]:
    """Per direction, the op's activation functions (alpha/beta consumed in order)."""
    defaults = _GATES[op][1]
    names = [_text(n) for n in attr.get("activations", ())] or defaults * dirs
    if len(names) == len(defaults) and dirs == 2:
        names = names * 2
    alphas, betas = list(attr.get("activation_alpha", ())), list(attr.get("activation_beta", ()))
    made = []
    for name in names:
        key = name.lower()
        a = float(alphas.pop(0)) if key in _TAKES_ALPHA and alphas else None
        b = float(betas.pop(0)) if key in _TAKES_BETA and betas else None
        made.append(_activation(name, a, b, dtype, node))
    per = len(defaults)
    return [made[d * per : (d + 1) * per] for d in range(dirs)]


def _input(inputs: list[Any], i: int) -> Any:
    return inputs[i] if i < len(inputs) else None


def _recurrent(bb: Any, op: str, inputs: list[Any], attr: dict[str, Any]) -> Any:
    """Y, Y_h (and Y_c for LSTM) of one RNN/GRU/LSTM node, unrolled."""
    import tvm
    from tvm import relax

    node = str(attr.get("tvm_custom", {}).get("name") or "<unnamed>")
    x, w, r = inputs[0], inputs[1], inputs[2]
    direction = _text(attr.get("direction", "forward"))
    if direction not in _DIRECTIONS:
        raise BuildError(
            f"TVM: {op} node {node!r} has direction {direction!r}; expected forward, reverse "
            "or bidirectional"
        )
    flags = _DIRECTIONS[direction]
    layout = int(attr.get("layout", 0))
    dtype = x.ty.dtype
    if layout:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
    seq_dim, batch = list(x.ty.shape)[:2]
    if not isinstance(seq_dim, tvm.tirx.IntImm):
        raise BuildError(
            f"TVM cannot convert op {op!r} at node {node!r}: its sequence length is symbolic "
            f"({seq_dim}) and enginekit unrolls the recurrence over a static one. Build with "
            "static input shapes (a profile whose min = max for the sequence axis), or with "
            "another backend (e.g. --backend xla or onnxruntime)."
        )
    seq = int(seq_dim)
    hidden = int(attr.get("hidden_size") or int(list(r.ty.shape)[-1]))
    c = lambda v: relax.const(v, dtype)  # noqa: E731
    bias, lens = _input(inputs, 3), _input(inputs, 4)
    h_init, c_init, peep = _input(inputs, 5), _input(inputs, 6), _input(inputs, 7)
    clip = attr.get("clip")
    cut = (lambda v: relax.op.clip(v, -float(clip), float(clip))) if clip else (lambda v: v)
    acts = _activations(op, attr, len(flags), dtype, node)
    if lens is not None:
        # [seq, batch, 1] step masks, one per step, shared by the directions.
        lens = bb.emit(relax.op.astype(lens, "int64"))
        masks = [
            bb.emit(relax.op.expand_dims(relax.op.less(relax.const(t, "int64"), lens), [1]))
            for t in range(seq)
        ]
        started = masks[0]
    ys, finals = [], []
    for d, reverse in enumerate(flags):
        wd = bb.emit(relax.op.take(w, relax.const(d, "int64"), axis=0))
        rt = bb.emit(relax.op.permute_dims(relax.op.take(r, relax.const(d, "int64"), axis=0)))
        proj = relax.op.matmul(x, relax.op.permute_dims(wd))
        rb = None
        if bias is not None:
            bd = bb.emit(relax.op.take(bias, relax.const(d, "int64"), axis=0))
            wb, rb = _gate_parts(bb, bd, 2)
            proj = relax.op.add(proj, wb)
        proj = bb.emit(proj)
        steps = bb.emit(relax.op.split(proj, seq, axis=0)) if seq > 1 else None
        xs = [
            bb.emit(
                relax.op.squeeze(relax.TupleGetItem(steps, t) if steps is not None else proj, [0])
            )
            for t in range(seq)
        ]
        zeros = bb.emit(relax.op.zeros(relax.ShapeExpr([batch, hidden]), dtype))
        state = [
            bb.emit(relax.op.take(v, relax.const(d, "int64"), axis=0 if not layout else 1))
            if v is not None
            else zeros
            for v in ([h_init, c_init] if op == "LSTM" else [h_init])
        ]
        pd = None
        if op == "LSTM" and peep is not None:
            pd = _gate_parts(bb, bb.emit(relax.op.take(peep, relax.const(d, "int64"), axis=0)), 3)
        out: list[Any] = [None] * seq
        for t in reversed(range(seq)) if reverse else range(seq):
            new = _step(bb, op, xs[t], state, rt, rb, pd, acts[d], cut, attr, c)
            if lens is None:
                state, out[t] = new, new[0]
            else:
                state = [bb.emit(relax.op.where(masks[t], n, s)) for n, s in zip(new, state)]
                out[t] = bb.emit(relax.op.where(masks[t], new[0], zeros))
        if lens is not None:
            # ONNX Runtime (the reference) gives an empty sequence zero final states, not
            # its initial ones.
            state = [bb.emit(relax.op.where(started, s, zeros)) for s in state]
        ys.append(bb.emit(relax.op.stack(out, axis=0)))  # [seq, batch, hidden]
        finals.append(state)
    y = bb.emit(relax.op.stack(ys, axis=1))  # [seq, dirs, batch, hidden]
    results = [
        bb.emit(relax.op.stack([f[i] for f in finals], axis=0)) for i in range(len(finals[0]))
    ]
    if layout:
        y = bb.emit(relax.op.permute_dims(y, [2, 0, 1, 3]))
        results = [bb.emit(relax.op.permute_dims(v, [1, 0, 2])) for v in results]
    return relax.Tuple([y, *results])


def _gate_parts(bb: Any, v: Any, gates: int) -> list[Any]:
    """``v`` split into its gates' blocks on the last axis (pre-activations, R^T, a bias)."""
    from tvm import relax

    if gates == 1:
        return [v]
    parts = bb.emit(relax.op.split(v, gates, axis=-1))
    return [bb.emit(relax.TupleGetItem(parts, i)) for i in range(gates)]


def _step(
    bb: Any,
    op: str,
    x_t: Any,
    state: list[Any],
    rt: Any,
    rb: Any,
    peep: list[Any] | None,
    acts: list[Act],
    cut: Act,
    attr: dict[str, Any],
    c: Callable[[float], Any],
) -> list[Any]:
    """One time step: the new states (h first; LSTM's c second)."""
    from tvm import relax

    h = state[0]
    gates = _GATES[op][0]
    if op == "GRU" and int(attr.get("linear_before_reset", 0)) == 0:
        # h's gate multiplies r * H before the recurrent weights: z and r first.
        rz, rr, rh = _gate_parts(bb, rt, 3)
        rbz, rbr, rbh = _gate_parts(bb, rb, 3) if rb is not None else (None, None, None)
        xz, xr, xh = _gate_parts(bb, x_t, 3)

        def pre(xg: Any, hr: Any, rw: Any, rbg: Any) -> Any:
            v = relax.op.add(xg, relax.op.matmul(hr, rw))
            return cut(relax.op.add(v, rbg) if rbg is not None else v)

        z = bb.emit(acts[0](pre(xz, h, rz, rbz)))
        rg = bb.emit(acts[0](pre(xr, h, rr, rbr)))
        hh = bb.emit(acts[1](pre(xh, relax.op.multiply(rg, h), rh, rbh)))
        return [bb.emit(_gru_mix(z, hh, h, c))]
    rec = relax.op.matmul(h, rt)
    if rb is not None:
        rec = relax.op.add(rec, rb)
    if op == "RNN":
        return [bb.emit(acts[0](cut(relax.op.add(x_t, rec))))]
    if op == "GRU":  # linear_before_reset: r multiplies (H R_h + Rb_h)
        xz, xr, xh = _gate_parts(bb, x_t, 3)
        hz, hr, hh_lin = _gate_parts(bb, bb.emit(rec), 3)
        z = bb.emit(acts[0](cut(relax.op.add(xz, hz))))
        rg = bb.emit(acts[0](cut(relax.op.add(xr, hr))))
        hh = bb.emit(acts[1](cut(relax.op.add(xh, relax.op.multiply(rg, hh_lin)))))
        return [bb.emit(_gru_mix(z, hh, h, c))]
    # LSTM, gates i, o, f, c.
    cell = state[1]
    gi, go, gf, gc = _gate_parts(bb, bb.emit(relax.op.add(x_t, rec)), gates)
    if peep is not None:
        gi = relax.op.add(gi, relax.op.multiply(peep[0], cell))
        gf = relax.op.add(gf, relax.op.multiply(peep[2], cell))
    i = bb.emit(acts[0](cut(gi)))
    if int(attr.get("input_forget", 0)):
        f = bb.emit(relax.op.subtract(c(1.0), i))
    else:
        f = bb.emit(acts[0](cut(gf)))
    g = bb.emit(acts[1](cut(gc)))
    new_c = bb.emit(relax.op.add(relax.op.multiply(f, cell), relax.op.multiply(i, g)))
    if peep is not None:
        go = relax.op.add(go, relax.op.multiply(peep[1], new_c))
    o = bb.emit(acts[0](cut(go)))
    return [bb.emit(relax.op.multiply(o, acts[2](new_c))), new_c]


def _gru_mix(z: Any, hh: Any, h: Any, c: Callable[[float], Any]) -> Any:
    """(1 - z) * h~ + z * H."""
    from tvm import relax

    return relax.op.add(
        relax.op.multiply(relax.op.subtract(c(1.0), z), hh), relax.op.multiply(z, h)
    )
