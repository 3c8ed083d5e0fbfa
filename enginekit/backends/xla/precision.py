"""Reduced precision (bf16, fp16) in the lowering: which values are narrowed, which ops widen.

Weights and every traced float32 value are held in the reduced type; ``WIDE_OPS`` take float32
inputs; casts saturate. The lowering calls these around each op; the op functions know nothing
of precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Reduced precisions: the float type weights and activations are held in.
LOW_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}
#: Ops that compute in float32 at reduced precision (their inputs are cast up, their results
#: back down): statistics, exponentials and sums over many elements lose the most in 8 bits of
#: mantissa, and XLA fuses the casts into them.
WIDE_OPS = frozenset(
    {
        "LayerNormalization",
        "BatchNormalization",
        "InstanceNormalization",
        "GroupNormalization",
        "LpNormalization",
        "Softmax",
        "LogSoftmax",
        "CumSum",
        "ReduceMean",
        "ReduceSum",
        "ReduceL1",
        "ReduceL2",
        "ReduceSumSquare",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
    }
)


def narrow(value: Any, low: Any) -> Any:
    """A traced float32 value in the reduced type ``low``, saturating: finite values past the
    type's range become its largest value, not infinity. (Exporters write float32's lowest
    as "masked out"; as -inf a fully masked softmax row turns NaN instead of uniform.)"""
    if low is None or isinstance(value, (np.ndarray, np.generic)):
        return value
    if getattr(value, "dtype", None) != np.float32:
        return value
    import jax.numpy as jnp

    top = float(jnp.finfo(low).max)
    return jnp.where(jnp.isinf(value), value, jnp.clip(value, -top, top)).astype(low)


def widen(value: Any, low: Any) -> Any:
    """A reduced-precision value back in float32 (anything else unchanged)."""
    if low is None or value is None or getattr(value, "dtype", None) != low:
        return value
    return value.astype(np.float32)


def at_precision(op: str, args: list[Any], low: Any) -> list[Any]:
    """WIDE_OPS: float inputs up to float32. Others, beside a reduced-precision traced
    operand: float32 constants down to it (conv and dot want one type; elementwise ops would
    otherwise promote to float32). Inputs that decide shapes (Resize's scales) stay exact."""
    from enginekit.backends.xla.ops import STATIC_INPUTS

    if op in WIDE_OPS:
        return [widen(a, low) for a in args]
    if not any(getattr(a, "dtype", None) == low and not _static(a) for a in args):
        return args
    keep = STATIC_INPUTS.get(op, ())
    return [
        narrow_weight(a, low) if _static(a) and a.dtype == np.float32 and i not in keep else a
        for i, a in enumerate(args)
    ]


def _static(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def low_dtype(precision: str) -> Any:
    """The numpy dtype of a reduced precision name, or None for fp32."""
    if precision not in LOW_PRECISION:
        return None
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, LOW_PRECISION[precision]))


def narrow_weight(weight: np.ndarray, low: Any) -> np.ndarray:
    """A float32 constant in ``low``, saturating like :func:`narrow`."""
    if low is None or weight.dtype != np.float32:
        return weight
    import jax.numpy as jnp

    top = float(jnp.finfo(low).max)
    return np.where(np.isinf(weight), weight, np.clip(weight, -top, top)).astype(low)
