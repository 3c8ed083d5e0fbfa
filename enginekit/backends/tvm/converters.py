"""enginekit's ONNX converters, registered over TVM 0.27's Relax importer for the ops where
the stock one fails, is wrong, or hides ops from the layout pass (see docs/backends/tvm.md).

One class per ONNX op, named after it, subclassing the stock converter so its other
versions stay as they are.
"""

from __future__ import annotations

from typing import Any

from enginekit.backends.tvm.messages import not_constant
from enginekit.errors import BuildError

#: Ops TVM's importer converts but whose output shape depends on the input values, which the
#: compiled program cannot produce: refused before import, naming op and node.
DATA_DEPENDENT = {
    "NonMaxSuppression": "the number of selected boxes",
}


def converters() -> dict[str, Any]:
    """enginekit's converters, registered over the stock ones for the ops they fix."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    class Range(onnx_frontend.Range):
        """Range(0, seq, 1) with ``seq`` a symbolic dim: TVM 0.27 gives the result a fresh
        length (``range_len_0``), so position embeddings no longer match the tokens' shape
        and everything after the Add loses its shape (GPT-2's positions). Integer ranges with
        start 0, a constant step and a symbolic limit keep the limit in the length."""

        @classmethod
        def _impl_v12(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            start, limit, delta = (onnx_frontend.get_constant(i, params) for i in inputs)
            steps = [_int_scalar(start), _int_scalar(delta)]
            # From 0 with a positive step the length ceil(limit / step) is never negative
            # for a dim (limit >= 0); other ranges keep the stock conversion.
            if tvm.ir.is_prim_expr(limit) and steps[0] == 0 and (steps[1] or 0) > 0:
                dtype = str(getattr(limit, "dtype", None) or limit.ty)
                if dtype.startswith("int"):
                    return relax.op.arange(0, limit, steps[1], dtype)
            return super()._impl_v12(bb, inputs, attr, params)

    class Clip(onnx_frontend.Clip):
        """Clip (ReLU6 in MobileNets) as Relax maximum/minimum: TVM 0.27 emits it as an
        opaque TIR call, which ConvertLayout cannot see through, so every NHWC conv followed
        by a clip got a transpose on each side (70 in MobileNetV2)."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            low, high = float(attr.get("min", -np.inf)), float(attr.get("max", np.inf))
            if low > -np.inf:
                x = bb.emit(relax.op.maximum(x, relax.const(low, dtype)))
            if high < np.inf:
                x = bb.emit(relax.op.minimum(x, relax.const(high, dtype)))
            return x

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            if len(inputs) > 1 and inputs[1] is not None:
                low = cls._sanitize_nan_clip_bound(bb, inputs[1], for_min=True)
                x = bb.emit(relax.op.maximum(x, low))
            if len(inputs) > 2 and inputs[2] is not None:
                high = cls._sanitize_nan_clip_bound(bb, inputs[2], for_min=False)
                x = bb.emit(relax.op.minimum(x, high))
            return x

    class Resize(onnx_frontend.Resize):
        """Resize whose ``sizes`` is a shape with a symbolic batch (``F.interpolate(size=...)``
        exports Shape(x)[0:2] concatenated with constant H, W): TVM 0.27 reads every entry
        of the shape as an int and fails on the batch var. Only the spatial entries are
        used, so when they are constants the sizes become a plain constant."""

        @classmethod
        def _impl_v18(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            sizes = onnx_frontend.get_constant(inputs[3], params) if len(inputs) > 3 else None
            if isinstance(sizes, relax.ShapeExpr):
                spatial = list(sizes.values)[2:]
                if all(isinstance(v, tvm.tirx.IntImm) for v in spatial):
                    inputs = onnx_frontend.onnx_input(inputs)
                    inputs[3] = relax.const(np.array([0, 0] + [int(v) for v in spatial], np.int64))
            return super()._impl_v18(bb, inputs, attr, params)

    class Gather(onnx_frontend.Gather):
        """Gather(Shape(x), [k]) with a one-element index vector (enginekit's
        make_batch_dynamic reads the batch that way): TVM 0.27 keeps a shape only for a 0-D
        index and otherwise turns it into a runtime tensor, so a later Expand or Reshape to
        it loses every dim (ViT's class token, then "Reshape expects the input tensor to
        have known shape"). A constant 1-D index into a shape stays a shape."""

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data = inputs[0]
            indices = onnx_frontend.get_constant(inputs[1], params)
            if (
                isinstance(data, relax.ShapeExpr)
                and attr.get("axis", 0) == 0
                and isinstance(indices, tvm.ir.GenericConst)
            ):
                picked = indices.value.numpy()
                dims = list(data.values)
                if (
                    picked.ndim == 1
                    and np.issubdtype(picked.dtype, np.integer)
                    and all(-len(dims) <= int(i) < len(dims) for i in picked)
                ):
                    return relax.ShapeExpr([dims[int(i)] for i in picked])
            return super()._impl_v13(bb, inputs, attr, params)

    class Cosh(onnx_frontend.OnnxOpConverter):
        """cosh(x) = (e^x + e^-x) / 2: TVM 0.27 imports Cosh as ``tirx.cosh``, which its LLVM
        codegen does not know ("unknown intrinsic"), so the build failed at compile time."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _exp_pair(bb, inputs[0], relax.op.add)

    class Sinh(onnx_frontend.OnnxOpConverter):
        """sinh(x) = (e^x - e^-x) / 2, for the same reason as :class:`Cosh`."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _exp_pair(bb, inputs[0], relax.op.subtract)

    class HardSigmoid(onnx_frontend.HardSigmoid):
        """max(0, min(1, alpha * x + beta)) as Relax maximum/minimum: the stock converter's
        ``clip`` is opaque to ConvertLayout, like :class:`Clip` (MobileNetV3's
        squeeze-excite and hard-swish left 63 transposes in torchvision's small model)."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            alpha = relax.const(float(attr.get("alpha", 0.2)), dtype)
            beta = relax.const(float(attr.get("beta", 0.5)), dtype)
            y = bb.emit(relax.op.add(relax.op.multiply(x, alpha), beta))
            return _unit_clamp(bb, y, 0.0, 1.0)

    class HardSwish(onnx_frontend.HardSwish):
        """x * max(0, min(6, x + 3)) / 6 without ``clip`` (see :class:`HardSigmoid`)."""

        @classmethod
        def _impl_v14(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            shifted = bb.emit(relax.op.add(x, relax.const(3.0, dtype)))
            gate = _unit_clamp(bb, shifted, 0.0, 6.0)
            return bb.emit(relax.op.multiply(x, relax.op.divide(gate, relax.const(6.0, dtype))))

    class LayerNormalization(onnx_frontend.LayerNormalization):
        """Normalizes over every axis from ``axis`` on, and computes the optional ``Mean`` and
        ``InvStdDev`` outputs: TVM 0.27 takes the axes from the scale's rank (wrong for a
        broadcast scale) and returns the constant 0 for both extra outputs (ONNX's
        layer-norm test cases with them, e.g. axis 0, mismatched). Unused extra outputs are
        removed by dead-code elimination; ``Y`` stays TVM's fused layer_norm."""

        @classmethod
        def _impl_v17(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data, scale = inputs[0], inputs[1]
            bias = inputs[2] if len(inputs) > 2 else None
            ndim = data.ty.ndim
            if ndim < 0 or scale.ty.shape is None:
                return super()._impl_v17(bb, inputs, attr, params)
            axis = int(attr.get("axis", -1)) % ndim
            axes = list(range(axis, ndim))
            eps = float(attr.get("epsilon", 1e-5))
            dtype = data.ty.dtype
            shape = list(data.ty.shape)[axis:]
            # TVM's layer_norm wants gamma/beta of exactly the normalized shape.
            gamma = bb.emit(relax.op.broadcast_to(scale, shape))
            if bias is not None:
                beta = bb.emit(relax.op.broadcast_to(bias, shape))
            elif all(isinstance(d, tvm.tirx.IntImm) for d in shape):
                beta = relax.const(np.zeros([int(d) for d in shape]), dtype)
            else:
                return super()._impl_v17(bb, inputs, attr, params)
            y = bb.emit(relax.op.nn.layer_norm(data, gamma, beta, axes, eps))
            mean = bb.emit(relax.op.mean(data, axes, keepdims=True))
            centered = bb.emit(relax.op.subtract(data, mean))
            var = bb.emit(relax.op.mean(relax.op.multiply(centered, centered), axes, keepdims=True))
            inv = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, dtype))))
            return relax.Tuple([y, mean, inv])

    class CumProd(onnx_frontend.CumSum):
        """CumSum's conversion with ``cumprod`` (TVM 0.27 has the Relax op, no converter);
        exclusive and reverse as in ONNX."""

        @classmethod
        def _impl_v26(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data = inputs[0]
            axis = onnx_frontend.get_constant(inputs[1], params)
            if not isinstance(axis, tvm.ir.GenericConst):
                raise not_constant("CumProd", attr, "axis", "the axis")
            dim = int(axis.value.numpy().reshape(-1)[0])
            reverse = int(attr.get("reverse", 0)) != 0
            if reverse:
                data = bb.emit(relax.op.flip(data, dim))
            exclusive = int(attr.get("exclusive", 0)) != 0
            data = bb.emit(relax.op.cumprod(data, dim, exclusive=exclusive))
            return bb.emit(relax.op.flip(data, dim)) if reverse else data

    class Mish(onnx_frontend.Mish):
        """x * tanh(softplus(x)) with, for tiny ``e = exp(x)``, softplus(x) = e(1 - e/2) and
        tanh(s) = s: TVM 0.27 computes log(1 + e), which is 0 there, and its fast tanh is off
        by 2x for tiny arguments, so mish of a large negative x was wrong past ONNX's atol 1e-7
        (its mish case failed)."""

        @classmethod
        def _impl_v18(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            e = bb.emit(relax.op.exp(x))
            near = relax.op.multiply(
                e,
                relax.op.subtract(
                    relax.const(1.0, dtype), relax.op.multiply(e, relax.const(0.5, dtype))
                ),
            )
            far = relax.op.log(relax.op.add(relax.const(1.0, dtype), e))
            tiny = bb.emit(relax.op.less(e, relax.const(1e-4, dtype)))
            soft = bb.emit(relax.op.where(tiny, near, far))
            gate = relax.op.where(tiny, soft, relax.op.tanh(soft))
            return bb.emit(relax.op.multiply(x, gate))

    def infinite_extreme(stock: Any, sign: float) -> Any:
        """A ReduceMax (sign -1) or ReduceMin (+1) converter whose result over elements that
        are all -inf (+inf) is -inf (+inf): TVM 0.27 starts the reduction at the dtype's
        finite lowest (highest) value and returns that. ONNX's Attention body tests
        ``ReduceMax(bias) == -inf`` to give a fully masked row 0; the row became NaN. Over
        an empty set the result is the same infinity, as ONNX says; bool inputs reduce as
        uint8 (TVM has no bool extreme)."""

        def fix(cls: Any, version: int, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            impl = getattr(super(cls, cls), f"_impl_v{version}")
            x = inputs[0]
            if str(x.ty.dtype) == "bool":
                # TVM has no max/min value for bool ("Cannot decide max_value"): as uint8.
                cast = [bb.emit(relax.op.astype(x, "uint8")), *list(inputs)[1:]]
                y = bb.normalize(impl(bb, cast, attr, params))
                return bb.emit(relax.op.astype(y, "bool"))
            y = bb.normalize(impl(bb, inputs, attr, params))
            dtype = y.ty.dtype
            if str(dtype) not in ("float16", "float32", "float64"):
                return y
            bound = float(np.finfo(str(dtype)).max) * sign
            edge = relax.const(bound, dtype)
            # Only elements equal to the bound or beyond it (infinite) leave the bound.
            hits = bb.emit(relax.op.astype(relax.op.equal(inputs[0], edge), dtype))
            # Whether any element sits at the bound: a max over the indicators, which is
            # below 0.5 for an empty set too, whose min (max) is +inf (-inf).
            anyhit = getattr(onnx_frontend.ReduceMax, f"_impl_v{version}")
            hit = bb.normalize(anyhit(bb, [hits, *list(inputs)[1:]], attr, params))
            at_edge = relax.op.less_equal(y, edge) if sign < 0 else relax.op.greater_equal(y, edge)
            none = relax.op.less(hit, relax.const(0.5, dtype))
            infinite = relax.const(sign * np.inf, dtype)
            return bb.emit(relax.op.where(relax.op.logical_and(at_edge, none), infinite, y))

        return type(
            stock.__name__,
            (stock,),
            {
                "__doc__": infinite_extreme.__doc__,
                "_impl_v11": classmethod(lambda cls, *a: fix(cls, 11, *a)),
                "_impl_v18": classmethod(lambda cls, *a: fix(cls, 18, *a)),
            },
        )

    class SpaceToDepth(onnx_frontend.SpaceToDepth):
        """SpaceToDepth with ``mode="CRD"`` (channel, then the block's row and column); TVM
        0.27 ignores ``mode`` and always gives DCR's channel order."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            mode = attr.get("mode", b"DCR")
            if (mode.decode() if isinstance(mode, bytes) else str(mode)) != "CRD":
                return super()._impl_v1(bb, inputs, attr, params)
            size = int(attr["blocksize"])
            b, c, h, w = inputs[0].ty.shape
            x = relax.op.reshape(inputs[0], (b, c, h // size, size, w // size, size))
            x = relax.op.permute_dims(x, [0, 1, 3, 5, 2, 4])
            return relax.op.reshape(x, (b, c * size * size, h // size, w // size))

    class BitShift(onnx_frontend.BitShift):
        """A shift by the type's width or more, or by a negative amount (read as unsigned),
        gives what ONNX Runtime gives: 0, or -1 for a negative value shifted right; TVM 0.27
        emitted the bare LLVM shift, undefined there (ONNX's ``shift_ge_width`` cases)."""

        @classmethod
        def _impl_v11(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            y = bb.normalize(super()._impl_v11(bb, inputs, attr, params))
            x, shift = inputs[0], inputs[1]
            dtype, kind = str(y.ty.dtype), str(shift.ty.dtype)
            bits = np.dtype(dtype).itemsize * 8
            past = relax.op.greater_equal(shift, relax.const(bits, kind))
            if kind.startswith("int"):
                past = relax.op.logical_or(past, relax.op.less(shift, relax.const(0, kind)))
            fill: Any = relax.const(0, dtype)
            right = attr.get("direction", b"LEFT") in (b"RIGHT", "RIGHT")
            if right and dtype.startswith("int"):
                fill = relax.op.where(
                    relax.op.less(x, relax.const(0, dtype)), relax.const(-1, dtype), fill
                )
            return bb.emit(relax.op.where(past, fill, y))

    class BitCast(onnx_frontend.OnnxOpConverter):
        """The same bits read as another type of the same width (TOPI's ``reinterpret``); TVM
        0.27 has no converter."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            from onnx import helper
            from tvm import topi

            x = inputs[0]
            target = np.dtype(helper.tensor_dtype_to_np_dtype(int(attr["to"])))
            if target.itemsize != np.dtype(str(x.ty.dtype)).itemsize:
                name = attr["tvm_custom"]["name"] or "<unnamed>"
                raise BuildError(
                    f"TVM cannot convert op 'BitCast' at node {name!r} from {x.ty.dtype} to "
                    f"{target}: enginekit converts only between types of the same width. "
                    "Build with another backend (e.g. --backend onnxruntime)."
                )
            return bb.emit_te(topi.reinterpret, x, str(target))

    class EyeLike(onnx_frontend.EyeLike):
        """EyeLike whose ``dtype`` attribute differs from its input's (the output takes the
        attribute's, as ONNX says); TVM 0.27 refused it ("dtype mismatch")."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            dtype = inputs[0].ty.dtype
            if "dtype" in attr:
                dtype = onnx_frontend.get_type(attr["dtype"])
            return relax.op.eye_like(inputs[0], int(attr.get("k", 0)), dtype)

    class LpNormalization(onnx_frontend.OnnxOpConverter):
        """x / ||x||_p along ``axis`` (p 1 or 2); TVM 0.27 has no converter. A zero norm gives
        0, as ONNX Runtime does."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            axis, p = int(attr.get("axis", -1)), int(attr.get("p", 2))
            if p == 1:
                norm = relax.op.sum(relax.op.abs(x), [axis], keepdims=True)
            else:
                norm = relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), [axis], keepdims=True))
            norm = bb.emit(norm)
            zero = relax.const(0.0, dtype)
            safe = relax.op.where(relax.op.equal(norm, zero), relax.const(1.0, dtype), norm)
            return bb.emit(relax.op.divide(x, safe))

    class ReverseSequence(onnx_frontend.OnnxOpConverter):
        """Relax's reverse_sequence (TVM 0.27 has the op, no converter)."""

        @classmethod
        def _impl_v10(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            lens = bb.emit(relax.op.astype(inputs[1], "int64"))
            return bb.emit(
                relax.op.reverse_sequence(
                    inputs[0],
                    lens,
                    seq_axis=int(attr.get("time_axis", 0)),
                    batch_axis=int(attr.get("batch_axis", 1)),
                )
            )

    from enginekit.backends.tvm import deform, extra, pool, resize, rnn, text, windows

    return {
        **rnn.converters(),
        **windows.converters(),
        **text.converters(),
        **deform.converters(),
        **extra.converters(),
        **pool.converters(),
        "CumProd": CumProd,
        "EyeLike": EyeLike,
        "SpaceToDepth": SpaceToDepth,
        "BitShift": BitShift,
        "BitCast": BitCast,
        "ReduceMax": infinite_extreme(onnx_frontend.ReduceMax, -1.0),
        "ReduceMin": infinite_extreme(onnx_frontend.ReduceMin, 1.0),
        "Mish": Mish,
        "LpNormalization": LpNormalization,
        "ReverseSequence": ReverseSequence,
        "LayerNormalization": LayerNormalization,
        "HardSigmoid": HardSigmoid,
        "HardSwish": HardSwish,
        "Range": Range,
        "Clip": Clip,
        "Resize": resize.converter(Resize),
        "Gather": Gather,
        "Cosh": Cosh,
        "Sinh": Sinh,
    }


def _unit_clamp(bb: Any, x: Any, low: float, high: float) -> Any:
    """max(low, min(high, x)) in ``x``'s dtype, as two elementwise Relax ops."""
    from tvm import relax

    dtype = x.ty.dtype
    x = bb.emit(relax.op.maximum(x, relax.const(low, dtype)))
    return bb.emit(relax.op.minimum(x, relax.const(high, dtype)))


def _exp_pair(bb: Any, x: Any, combine: Any) -> Any:
    """``combine(e^x, e^-x) / 2`` in ``x``'s dtype."""
    from tvm import relax

    dtype = x.ty.dtype
    pos = bb.emit(relax.op.exp(x))
    neg = bb.emit(relax.op.exp(relax.op.negative(x)))
    return bb.emit(relax.op.multiply(combine(pos, neg), relax.const(0.5, dtype)))


def _int_scalar(value: Any) -> int | None:
    """The Python int in a one-element integer constant, else None."""
    import numpy as np
    import tvm

    if not isinstance(value, tvm.ir.GenericConst):
        return None
    array = value.value.numpy()
    if array.size != 1 or not np.issubdtype(array.dtype, np.integer):
        return None
    return int(array.item())
