"""Dynamic batch: rewrite a fixed batch (legacy exporters included) and lint the result."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import onnx

from enginekit.errors import ModelError
from enginekit.model import (
    ModelSource,
    concrete_shapes,
    load_model,
    random_feeds,
    reference_session,
)
from enginekit.passes.batch_proof import Dims, fold_shape_constants, onnx_dims, ort_dims
from enginekit.passes.batch_rules import PROVERS, rewrite_round
from enginekit.passes.graph import _copy

#: What to do about a constant that could not be proven (said with each one).
UNPROVEN_HELP = (
    " — run lint_batch on the result; if it fails, re-export the model with a dynamic batch, "
    "or set that constant's first entry to 0 (copy dim 0 of the data input) or -1 yourself"
)

log = logging.getLogger("enginekit.passes")


@dataclasses.dataclass(frozen=True)
class BatchRewrite:
    """What :func:`rewrite_batch` did.

    Attributes:
        model: the rewritten model.
        batch: the fixed batch size found on the inputs (None: it was dynamic already).
        rewritten: one line per change made.
        unproven: one line per constant that may hold the batch size but could not be proven
            to; check the model with :func:`lint_batch` and fix these by hand if it fails.
    """

    model: onnx.ModelProto
    batch: int | None
    rewritten: tuple[str, ...]
    unproven: tuple[str, ...]


def _drop_initializer_inputs(proto: onnx.ModelProto) -> int:
    """Remove initializers from the graph inputs (old exporters list them there, which makes
    them overridable inputs: nothing that depends on them can be folded or proven constant)."""
    init = {t.name for t in proto.graph.initializer}
    keep = [v for v in proto.graph.input if v.name not in init]
    dropped = len(proto.graph.input) - len(keep)
    if dropped:
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
        proto.ir_version = max(proto.ir_version, 4)  # IR < 4 requires initializers as inputs
    return dropped


def _fixed_batch(proto: onnx.ModelProto) -> int | None:
    sizes = set()
    for v in proto.graph.input:
        dims = v.type.tensor_type.shape.dim
        if not dims:
            raise ModelError(f"input {v.name!r} is a scalar; it has no batch dim to make dynamic")
        if dims[0].HasField("dim_value"):
            sizes.add(dims[0].dim_value)
    if len(sizes) > 1:
        raise ModelError(
            f"inputs disagree on their leading dim ({sorted(sizes)}); no single batch dim"
        )
    return sizes.pop() if sizes else None


def _static_dims(proto: onnx.ModelProto) -> dict[str, Dims]:
    """Every tensor's shape in the fixed model: ONNX's inference, or ONNX Runtime's symbolic
    one where only it computes every dim (it evaluates shape arithmetic ONNX's leaves open)."""
    merged = dict(onnx_dims(proto))
    for name, dims in ort_dims(proto).items():
        known = merged.get(name)
        if all(isinstance(d, int) for d in dims) and (
            known is None or not all(isinstance(d, int) for d in known)
        ):
            merged[name] = dims
    return merged


def rewrite_batch(
    source: ModelSource, name: str = "batch", provers: Sequence[str] = PROVERS
) -> BatchRewrite:
    """Make a fixed leading batch dim symbolic, and fix the constants that bake it in.

    Handles models from old exporters: initializers listed as graph inputs are removed from
    the inputs; then, round after round, the batch is proven through the graph (ONNX shape
    inference with a symbolic batch, ONNX Runtime's symbolic shape inference, and dim 0
    followed through ops that keep it) and the constants that bake it in are rewritten:
    Reshape shapes (the ``[1, N]`` after global pooling, the channel shuffle's
    ``[1, g, c/g, h, w]``, shapes built by Concat), ``Flatten(axis=0)`` at batch 1, and the
    Expand/Tile/ConstantOfShape constants (or batch-less tensors such as a class token) joined
    to the batch in a Concat. See :mod:`enginekit.passes.batch_rules`. Each rewrite names its
    proof; constants that may hold the batch but cannot be proven to are listed in
    ``unproven`` by node, not changed.

    Args:
        name: the symbolic dim's name.
        provers: which proofs to use (default all of :data:`PROVERS`); fewer is for measuring.
    """
    unknown = sorted(set(provers) - set(PROVERS))
    if unknown:
        raise ModelError(f"rewrite_batch: unknown prover(s) {unknown}; expected {PROVERS}")
    proto = _copy(source)
    rewritten: list[str] = []
    dropped = _drop_initializer_inputs(proto)
    if dropped:
        rewritten.append(f"{dropped} initializer(s) removed from the graph inputs")
    batch = _fixed_batch(proto)
    if batch is not None:
        folded = fold_shape_constants(proto)
        if folded:
            rewritten.append(f"{folded} constant shape computation(s) folded")
    # Every tensor's shape at the fixed batch: the layout proof follows the batch through them.
    static = _static_dims(proto) if batch is not None else {}
    for v in list(proto.graph.input) + list(proto.graph.output):
        dims = v.type.tensor_type.shape.dim
        if dims and (dims[0].HasField("dim_param") or dims[0].dim_value == batch):
            dims[0].Clear()
            dims[0].dim_param = name
    del proto.graph.value_info[:]
    unproven: list[str] = []
    if batch is not None:
        done: set[str] = set()
        while True:
            changed, unproven = rewrite_round(proto, batch, name, done, provers, static)
            rewritten += changed
            if not changed:
                break
    for line in rewritten:
        log.info("make_batch_dynamic: %s", line)
    for line in unproven:
        log.warning("make_batch_dynamic: %s%s", line, UNPROVEN_HELP)
    return BatchRewrite(proto, batch, tuple(rewritten), tuple(unproven))


def make_batch_dynamic(
    source: ModelSource, name: str = "batch", *, strict: bool = False
) -> onnx.ModelProto:
    """Rewrite a fixed leading batch dim of inputs and outputs to the symbolic dim ``name``.

    See :func:`rewrite_batch` for what is rewritten; what could not be proven is logged as a
    warning (or, with ``strict=True``, raised). Run :func:`lint_batch` on the result to confirm
    every output follows the batch.

    Raises:
        ModelError: with ``strict=True``, a node that may bake the batch in could not be proven;
            the message names each one and says what to do.
    """
    result = rewrite_batch(source, name)
    if strict and result.unproven:
        raise ModelError(
            "make_batch_dynamic could not prove these constants follow the batch:\n  "
            + "\n  ".join(result.unproven)
            + "\n"
            + UNPROVEN_HELP.removeprefix(" — ").capitalize()
        )
    return result.model


@dataclasses.dataclass(frozen=True)
class LintIssue:
    """An output whose leading dim did not follow the batch size."""

    output: str
    batch: int
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"output {self.output!r} has shape {self.shape} at batch {self.batch}: its leading "
            "dim does not follow the batch (a batch size baked into a Reshape/Expand constant?)"
        )


def lint_batch(
    source: ModelSource,
    sizes: Sequence[int] = (1, 3),
    dims: Mapping[str, int] | None = None,
) -> list[LintIssue]:
    """Run the model at each batch size on ONNX Runtime CPU; report outputs that did not follow.

    Returns an empty list when every output's leading dim equals the batch size at every size.

    Raises:
        ModelError: the model has no dynamic leading dim on its inputs, or cannot run.
    """
    model = load_model(source)
    if not all(s.shape and isinstance(s.shape[0], str) for s in model.inputs):
        raise ModelError(
            "batch lint: not every input has a dynamic leading dim; run make_batch_dynamic first"
        )
    session = reference_session(model)
    names = [o.name for o in model.outputs]
    issues = []
    for b in sizes:
        feeds = random_feeds(model.inputs, concrete_shapes(model.inputs, None, batch=b, dims=dims))
        try:
            results = session.run(names, feeds)
        except Exception as exc:
            raise ModelError(f"batch lint: the model fails at batch {b}: {exc}") from None
        for n, r in zip(names, results):
            if r.ndim == 0 or r.shape[0] != b:
                issues.append(LintIssue(n, b, tuple(r.shape)))
    return issues
