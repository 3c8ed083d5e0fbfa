"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (models exported with
their loss, and the ONNX test data).

One function per op, inputs positional, attributes as keywords with the spec's defaults.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from enginekit.backends.xla.ops.common import OpError, to_jax

_REDUCTIONS = ("none", "sum", "mean")


def _nll(
    log_prob: Any, target: Any, weight: Any, ignore_index: int | None, reduction: str, op: str
) -> Any:
    """The per-element loss -log_prob[n, target[n, ...], ...], weighted and reduced.

    ``mean`` divides by the sum of the weights that applied (ignored targets weigh 0); with
    neither weights nor an ignore_index every element counts, as the spec's reference does.
    """
    if reduction not in _REDUCTIONS:
        raise OpError(f"{op} reduction {reduction!r}: expected one of {', '.join(_REDUCTIONS)}")
    if log_prob.ndim < 2:
        raise OpError(f"{op} needs an input of rank 2 or more ([N, C, ...]), got rank 1")
    classes = log_prob.shape[1]
    t = to_jax(target)
    picked = jnp.clip(t, 0, classes - 1)
    loss = -jnp.squeeze(jnp.take_along_axis(log_prob, picked[:, None], axis=1), axis=1)
    kept = jnp.ones(t.shape, jnp.bool_) if ignore_index is None else t != ignore_index
    loss = jnp.where(kept, loss, jnp.zeros((), loss.dtype))
    scale = None
    if weight is not None:
        scale = jnp.where(kept, jnp.take(to_jax(weight), picked), 0).astype(loss.dtype)
    elif ignore_index is not None:
        scale = kept.astype(loss.dtype)
    if scale is not None:
        loss = loss * scale
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    if scale is not None:
        return jnp.sum(loss) / jnp.sum(scale)
    return jnp.mean(loss)


def NegativeLogLikelihoodLoss(
    input: Any,
    target: Any,
    weight: Any = None,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Any:
    x = to_jax(input)
    # The reference (what ONNX Runtime matches) weighs nothing for ignore_index=-1 without
    # weights: a plain mean over every element, ignored ones counting as 0.
    if weight is None and ignore_index == -1 and reduction == "mean":
        return jnp.mean(_nll(x, target, None, -1, "none", "NegativeLogLikelihoodLoss"))
    return _nll(x, target, weight, ignore_index, reduction, "NegativeLogLikelihoodLoss")


def SoftmaxCrossEntropyLoss(
    scores: Any,
    labels: Any,
    weights: Any = None,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> tuple[Any, Any]:
    """Returns (output, log_prob)."""
    log_prob = jax.nn.log_softmax(to_jax(scores), axis=1)
    loss = _nll(log_prob, labels, weights, ignore_index, reduction, "SoftmaxCrossEntropyLoss")
    return loss.astype(log_prob.dtype), log_prob
