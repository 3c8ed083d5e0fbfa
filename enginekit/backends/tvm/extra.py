"""enginekit's converters over TVM 0.27's for single ops it gets wrong or lacks:

- ``RMSNormalization``: its ``rms_norm`` failed to compile a ``scale`` broadcast rather than
  of the normalized shape ("Tensor dimension mismatch in read", ONNX's axis-0 cases with a
  scale of the last dim only).
- ``Pow``: refused an exponent of another type than the base's.
- ``Elu`` and ``Selu``: built their constants as float32, so any other float type failed
  ("Binary operators must have the same datatype"; ONNX's float16 Celu, whose body is an Elu).
- ``OneHot``: refused ``values`` that are not a constant.
- ``Mod`` of floats with ``fmod=0``: NaN for an infinite divisor.
- ``Slice`` before opset 10 (attributes, not inputs): not converted.
- ``Upsample``: ``scales`` as an input (opset 9) was not read, and nearest rounded.
- ``Split`` with sizes of 0: failed after import.
- ``Unsqueeze`` with a 0-d constant ``axes`` (ONNX Runtime takes one): iterated over it.
- ``IsInf``: ignored ``detect_negative`` and ``detect_positive``.
- ``HannWindow``, ``HammingWindow``, ``BlackmanWindow``: no converter; their sizes are value
  inputs (:mod:`enginekit.backends.tvm.values`), so the window is a constant.
"""

from __future__ import annotations

from typing import Any


def converters() -> dict[str, Any]:
    """The converters of this module, by op type."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    class RMSNormalization(onnx_frontend.RMSNormalization):
        """``x / sqrt(mean(x^2 over axis..last) + epsilon) * scale`` with numpy broadcasting
        of ``scale``, in float32 unless ``stash_type`` says otherwise."""

        @classmethod
        def _impl_v23(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data, scale = inputs[0], inputs[1]
            ndim = data.ty.ndim
            if ndim < 0:
                return super()._impl_v23(bb, inputs, attr, params)
            axes = list(range(int(attr.get("axis", -1)) % ndim, ndim))
            eps = float(attr.get("epsilon", 1e-5))
            dtype = str(data.ty.dtype)
            work = "float32" if int(attr.get("stash_type", 1)) == 1 else dtype
            x = bb.emit(relax.op.astype(data, work)) if work != dtype else data
            mean = relax.op.mean(relax.op.multiply(x, x), axes, keepdims=True)
            inv = bb.emit(relax.op.rsqrt(relax.op.add(mean, relax.const(eps, work))))
            y = bb.emit(relax.op.multiply(x, inv))
            if work != dtype:
                y = bb.emit(relax.op.astype(y, dtype))
            return bb.emit(relax.op.multiply(y, scale))

    class Pow(onnx_frontend.Pow):
        """Pow whose exponent's type differs from the base's (ONNX allows it; the result has
        the base's type): computed in float64 and cast back, truncating as ONNX Runtime's
        ``static_cast`` does; integer powers likewise. TVM 0.27 refused the first ("Binary
        operators must have the same datatype") and failed to compile the second ("power only
        applies to float"). Float powers of one type keep TVM's conversion."""

        @classmethod
        def _impl_v7(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x, y = inputs[0], inputs[1]
            kinds = (getattr(x.ty, "dtype", None), getattr(y.ty, "dtype", None))
            if None in kinds or (str(kinds[0]) == str(kinds[1]) and "float" in str(kinds[0])):
                return super()._impl_v7(bb, inputs, attr, params)
            wide = relax.op.power(relax.op.astype(x, "float64"), relax.op.astype(y, "float64"))
            return bb.emit(relax.op.astype(wide, str(kinds[0])))

    class Elu(onnx_frontend.Elu):
        """``-alpha * relu(1 - e^x) + relu(x)`` with constants of ``x``'s type."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _elu(bb, inputs[0], float(attr.get("alpha", 1.0)), 1.0)

    class Selu(onnx_frontend.Selu):
        """``gamma * elu_alpha(x)`` with constants of ``x``'s type."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            alpha = float(attr.get("alpha", 1.67326319217681884765625))
            gamma = float(attr.get("gamma", 1.05070102214813232421875))
            return _elu(bb, inputs[0], alpha, gamma)

    class OneHot(onnx_frontend.OneHot):
        """OneHot whose ``values`` (off, on) are computed or fed at run time: a one-hot mask
        picks between them. A constant ``depth`` is still needed (it sizes the output; it
        is a value input, so it is one here); constant ``values`` keep TVM's conversion."""

        @classmethod
        def _impl_v11(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            depth = onnx_frontend.get_constant(inputs[1], params)
            values = onnx_frontend.get_constant(inputs[2], params)
            constant = isinstance(values, tvm.ir.GenericConst)
            if constant or not isinstance(depth, tvm.ir.GenericConst):
                if constant:
                    inputs = onnx_frontend.onnx_input(inputs)
                    inputs[1] = _integral(depth)
                return super()._impl_v11(bb, inputs, attr, params)
            size = int(depth.value.numpy().reshape(-1)[0])
            indices = inputs[0]
            if size < 1:
                # An empty axis (ONNX Runtime gives one; TVM's one_hot refuses depth 0).
                dims = list(indices.ty.shape)
                axis = int(attr.get("axis", -1)) % (len(dims) + 1)
                return relax.op.zeros([*dims[:axis], 0, *dims[axis:]], values.ty.dtype)
            if "float" in str(indices.ty.dtype):
                # ONNX Runtime casts float indices to int64 (truncating) as well.
                indices = bb.emit(relax.op.astype(indices, "int64"))
            kind = str(indices.ty.dtype)
            extent = relax.const(size, kind)
            indices = onnx_frontend._normalize_negative_indices(bb, indices, extent)
            one, zero = (
                relax.prim_value(tvm.tirx.IntImm("int32", 1)),
                relax.prim_value(tvm.tirx.IntImm("int32", 0)),
            )
            # TOPI's one_hot takes -1 only: other negative axes counted from the output's end.
            axis = int(attr.get("axis", -1)) % (indices.ty.ndim + 1)
            mask = bb.emit(relax.op.one_hot(indices, one, zero, size, axis))
            hot = bb.emit(relax.op.equal(mask, relax.const(1, "int32")))
            off = bb.emit(relax.op.take(values, relax.const(0, "int64"), axis=0))
            on = bb.emit(relax.op.take(values, relax.const(1, "int64"), axis=0))
            return bb.emit(relax.op.where(hot, on, off))

    class Mod(onnx_frontend.Mod):
        """Float ``Mod`` with ``fmod=0`` (numpy's floor mod) as the truncated remainder moved
        by ``y`` where their signs differ: TVM 0.27's ``floor_mod`` is ``x - floor(x / y) *
        y``, NaN for an infinite ``y`` (``mod(-3, inf)`` is ``inf``, ``mod(3, inf)`` is 3)."""

        @classmethod
        def _impl_v10(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x, y = inputs[0], inputs[1]
            dtype = str(getattr(x.ty, "dtype", ""))
            if int(attr.get("fmod", 0)) != 0 or "float" not in dtype:
                return super()._impl_v10(bb, inputs, attr, params)
            rem = bb.emit(relax.op.mod(x, y))
            zero = relax.const(0.0, dtype)
            differ = relax.op.logical_xor(relax.op.less(rem, zero), relax.op.less(y, zero))
            moved = relax.op.logical_and(relax.op.not_equal(rem, zero), differ)
            return bb.emit(relax.op.where(moved, relax.op.add(rem, y), rem))

    class Slice(onnx_frontend.Slice):
        """Slice before opset 10, whose ``starts``, ``ends`` and ``axes`` are attributes:
        TVM 0.27 converts only the input form ("Cannot cast NoneType to list of Expr")."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            starts = [int(v) for v in attr["starts"]]
            ends = [int(v) for v in attr["ends"]]
            axes = [int(v) for v in attr.get("axes", range(len(starts)))]
            return bb.emit(relax.op.strided_slice(inputs[0], axes, starts, ends))

    class Upsample(onnx_frontend.Upsample):
        """Upsample with ``scales`` an input (opset 9; a value input, so a constant here) or
        an attribute (opset 7), nearest picking ``floor(out / scale)`` as ONNX says: TVM 0.27
        read only the attribute ("NoneType has no len()") and rounded to the nearest source
        pixel (a scale of 3 took pixel 1 for output 2, not 0)."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            scales = attr.get("scales")
            if scales is None and len(inputs) > 1:
                found = onnx_frontend.get_constant(inputs[1], params)
                if isinstance(found, tvm.ir.GenericConst):
                    scales = [float(v) for v in found.value.numpy()]
            mode = attr.get("mode", b"nearest")
            mode = mode.decode() if isinstance(mode, bytes) else str(mode)
            shape = list(inputs[0].ty.shape)
            if (
                scales is None
                or len(scales) != 4
                or len(shape) != 4
                or list(scales[:2]) != [1.0, 1.0]
                or not all(isinstance(d, tvm.tirx.IntImm) for d in shape[2:])
            ):
                return super()._impl_v9(bb, inputs, attr, params)
            size = [int(int(d) * s) for d, s in zip(shape[2:], scales[2:])]
            nearest = mode == "nearest"
            return relax.op.image.resize2d(
                inputs[0],
                relax.ShapeExpr(size),
                layout="NCHW",
                method="nearest_neighbor" if nearest else mode,
                coordinate_transformation_mode="asymmetric",
                rounding_method="floor" if nearest else "round",
            )

    class Split(onnx_frontend.Split):
        """Split with constant sizes that include 0: a strided slice per output. TVM 0.27's
        ``split`` takes strictly increasing split points and failed after import ("split_indices
        must be sorted"), past the frontend's own error handling."""

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            found = None
            if len(inputs) > 1 and inputs[1] is not None:
                found = onnx_frontend.get_constant(inputs[1], params)
            sizes = None
            if isinstance(found, tvm.ir.GenericConst):
                sizes = [int(v) for v in found.value.numpy().reshape(-1)]
            if not sizes or min(sizes) > 0:
                return super()._impl_v13(bb, inputs, attr, params)
            axis = int(attr.get("axis", 0))
            pieces, start = [], 0
            for size in sizes:
                pieces.append(
                    bb.emit(relax.op.strided_slice(inputs[0], [axis], [start], [start + size]))
                )
                start += size
            return relax.Tuple(pieces)

    def _axes_vector(inputs: Any, params: Any) -> Any:
        """``inputs`` with a 0-d constant ``axes`` (input 1) made a one-element vector: ONNX
        Runtime takes a scalar there (ONNX's ``AffineGrid`` body unsqueezes by the constant
        ``-1``), TVM 0.27 iterated over it ("'int' object is not iterable")."""
        axes = onnx_frontend.get_constant(inputs[1], params) if len(inputs) > 1 else None
        if not isinstance(axes, tvm.ir.GenericConst) or axes.value.numpy().ndim != 0:
            return inputs
        inputs = onnx_frontend.onnx_input(inputs)
        inputs[1] = relax.const(axes.value.numpy().reshape(1).astype("int64"), "int64")
        return inputs

    class Unsqueeze(onnx_frontend.Unsqueeze):
        """Unsqueeze whose ``axes`` is a 0-d constant (see ``_axes_vector``)."""

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return super()._impl_v13(bb, _axes_vector(inputs, params), attr, params)

    class IsInf(onnx_frontend.IsInf):
        """IsInf with ``detect_negative``/``detect_positive``: TVM 0.27 ignored both."""

        @classmethod
        def _impl_v10(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            y = relax.op.isinf(x)
            zero = relax.const(0, x.ty.dtype)
            if not int(attr.get("detect_negative", 1)):
                y = relax.op.logical_and(y, relax.op.greater(x, zero))
            if not int(attr.get("detect_positive", 1)):
                y = relax.op.logical_and(y, relax.op.less(x, zero))
            return bb.emit(y)

    def _integral(depth: Any) -> Any:
        """A float ``depth`` constant as int64 (TVM's one_hot takes an int depth)."""
        if not isinstance(depth, tvm.ir.GenericConst):
            return depth
        return relax.const(depth.value.numpy().astype("int64"), "int64")

    return {
        "RMSNormalization": RMSNormalization,
        "Pow": Pow,
        "Elu": Elu,
        "Selu": Selu,
        "OneHot": OneHot,
        "Mod": Mod,
        "Slice": Slice,
        "Upsample": Upsample,
        "Split": Split,
        "Unsqueeze": Unsqueeze,
        "IsInf": IsInf,
        **{op: _window_converter(op, coefficients) for op, coefficients in WINDOWS.items()},
    }


#: Cosine-sum windows: op -> a_k in ``sum_k (-1)^k a_k cos(2 pi k n / N)`` (ONNX's
#: definitions; Hamming's are 25/46 and 21/46, not 0.54 and 0.46).
WINDOWS: dict[str, tuple[float, ...]] = {
    "HannWindow": (0.5, 0.5),
    "HammingWindow": (25 / 46, 21 / 46),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}


def window(size: int, coefficients: tuple[float, ...], periodic: bool) -> Any:
    """The window of ``size`` points in float64: ``N`` is ``size`` when periodic, else
    ``size - 1``, as ONNX defines them."""
    import numpy as np

    n = np.arange(size, dtype=np.float64)
    length = size if periodic else size - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        angle = 2 * np.pi * n / length
    out = np.zeros(size, np.float64)
    for k, a in enumerate(coefficients):
        out += (-1) ** k * a * np.cos(k * angle)
    return out


def _window_converter(op: str, coefficients: tuple[float, ...]) -> Any:
    """A converter for the window op ``op``: its ``size`` must be a constant."""
    from onnx import helper
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    from enginekit.backends.tvm.messages import not_constant

    def impl(cls: Any, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
        import numpy as np
        import tvm

        size = onnx_frontend.get_constant(inputs[0], params)
        if not isinstance(size, tvm.ir.GenericConst):
            raise not_constant(op, attr, "size", "the window")
        points = int(size.value.numpy().reshape(-1)[0])
        values = window(points, coefficients, int(attr.get("periodic", 1)) != 0)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(int(attr.get("output_datatype", 1))))
        # relax.const keeps no 64-bit type of a numpy array unless told (int64 became int32).
        return relax.const(values.astype(dtype), str(dtype))

    return type(
        op,
        (onnx_frontend.OnnxOpConverter,),
        {"__doc__": f"{op} as a constant computed from its size.", "_impl_v17": classmethod(impl)},
    )


def _elu(bb: Any, x: Any, alpha: float, gamma: float) -> Any:
    """``gamma * (-alpha * relu(1 - e^x) + relu(x))`` in ``x``'s dtype."""
    from tvm import relax

    dtype = x.ty.dtype
    neg = relax.op.nn.relu(relax.op.subtract(relax.const(1.0, dtype), relax.op.exp(x)))
    y = relax.op.add(relax.op.multiply(relax.const(-alpha, dtype), neg), relax.op.nn.relu(x))
    if gamma != 1.0:
        y = relax.op.multiply(relax.const(gamma, dtype), y)
    return bb.emit(y)
