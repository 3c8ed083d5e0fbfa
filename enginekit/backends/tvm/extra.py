"""enginekit's ``RMSNormalization`` and ``Pow`` converters over TVM 0.27's: its ``rms_norm``
failed to compile a ``scale`` broadcast rather than of the normalized shape ("Tensor dimension
mismatch in read", ONNX's axis-0 cases with a scale of the last dim only), and its Pow refused
an exponent of another type than the base's.
"""

from __future__ import annotations

from typing import Any


def converters() -> dict[str, Any]:
    """The ``RMSNormalization`` and ``Pow`` converters."""
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

    return {"RMSNormalization": RMSNormalization, "Pow": Pow}
