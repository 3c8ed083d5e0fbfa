"""Dynamic batch: rewrite a fixed batch (legacy exporters included) and lint the result."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.errors import ModelError
from enginekit.model import (
    ModelSource,
    concrete_shapes,
    load_model,
    random_feeds,
    reference_session,
)
from enginekit.passes.graph import _copy, infer_shapes

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


def _constants(
    proto: onnx.ModelProto,
) -> dict[str, tuple[np.ndarray, Callable[[np.ndarray], None]]]:
    """Constant tensors by name: their value and a setter that rewrites them in place."""
    found: dict[str, tuple[np.ndarray, Callable[[np.ndarray], None]]] = {}
    for t in proto.graph.initializer:

        def set_init(v: np.ndarray, t: onnx.TensorProto = t) -> None:
            t.CopyFrom(numpy_helper.from_array(v.astype(numpy_helper.to_array(t).dtype), t.name))

        found[t.name] = (numpy_helper.to_array(t), set_init)
    for node in proto.graph.node:
        if node.op_type != "Constant" or not node.output:
            continue
        for attr in node.attribute:
            if attr.name == "value":

                def set_t(v: np.ndarray, a: onnx.AttributeProto = attr) -> None:
                    a.t.CopyFrom(
                        numpy_helper.from_array(v.astype(numpy_helper.to_array(a.t).dtype))
                    )

                found[node.output[0]] = (numpy_helper.to_array(attr.t), set_t)
            elif attr.name == "value_ints":

                def set_ints(v: np.ndarray, a: onnx.AttributeProto = attr) -> None:
                    del a.ints[:]
                    a.ints.extend(int(x) for x in v)

                found[node.output[0]] = (np.array(attr.ints, np.int64), set_ints)
    return found


def _inferred_dims(proto: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    inferred = infer_shapes(proto)
    dims: dict[str, tuple[int | str | None, ...]] = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input):
        t = v.type.tensor_type
        if t.HasField("shape"):
            dims[v.name] = tuple(
                d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                for d in t.shape.dim
            )
    return dims


def _shared_constant(proto: onnx.ModelProto, name: str) -> bool:
    return sum(i == name for n in proto.graph.node for i in n.input) > 1


def _rewrite_round(
    proto: onnx.ModelProto, batch: int, sym: str, done: set[str]
) -> tuple[list[str], list[str]]:
    """One pass over the nodes: rewrite what shape inference proves, report what it cannot."""
    dims = _inferred_dims(proto)
    consts = _constants(proto)
    rewritten: list[str] = []
    unproven: list[str] = []
    for node in proto.graph.node:
        label = f"{node.op_type} {node.name or node.output[0]!r}"
        if label in done:
            continue
        src = dims.get(node.input[0]) if node.input else None
        if node.op_type == "Flatten":
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            if axis == 0 and batch == 1 and src and src[0] == sym:
                # At batch 1, Flatten(axis=0) == Flatten(axis=1); only axis=1 follows the batch.
                for a in node.attribute:
                    if a.name == "axis":
                        a.i = 1
                rewritten.append(f"{label}: axis 0 -> 1")
                done.add(label)
            continue
        shape_input = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0}.get(node.op_type)
        if shape_input is None or len(node.input) <= shape_input:
            continue
        const = consts.get(node.input[shape_input])
        if const is None:
            continue
        values, setter = const
        if values.ndim != 1 or not len(values) or values[0] != batch:
            continue
        if node.op_type == "Expand" and src and src[0] == sym:
            continue  # broadcasting already carries the batch through a leading 1
        if node.op_type == "Reshape":
            allowzero = any(a.name == "allowzero" and a.i == 1 for a in node.attribute)
            new = _reshape_batch(values, src, sym, allowzero)
            if new is not None:
                if _shared_constant(proto, node.input[1]):
                    fresh = f"{node.input[1]}__batch_dynamic"
                    proto.graph.initializer.append(numpy_helper.from_array(new, fresh))
                    node.input[1] = fresh
                else:
                    setter(new)
                rewritten.append(f"{label}: shape {values.tolist()} -> {new.tolist()}")
                done.add(label)
                continue
        if node.op_type == "ConstantOfShape":
            src = None  # its input is the shape itself; there is no data input to trace
        unproven.append(
            f"{label}: constant shape {values.tolist()} starts with the batch size {batch}, but "
            f"nothing proves it is the batch (data input shape: {src or 'unknown'})"
        )
    return rewritten, unproven


def _reshape_batch(
    values: np.ndarray, src: tuple[Any, ...] | None, sym: str, allowzero: bool
) -> np.ndarray | None:
    """The shape constant with the batch made dynamic, or None when that cannot be proven."""
    if not src:
        return None
    new = values.astype(np.int64).copy()
    if src[0] == sym and not allowzero:
        new[0] = 0  # copy the input's dim 0, which is the batch
        return new
    # The input holds the batch once and otherwise fixed dims: its size is batch * K, and the
    # other entries fix K, so -1 recovers the batch.
    if (
        sum(d == sym for d in src) == 1
        and all(isinstance(d, int) for d in src if d != sym)
        and -1 not in values[1:].tolist()
        and (allowzero or 0 not in values[1:].tolist())
    ):
        new[0] = -1
        return new
    return None


def rewrite_batch(source: ModelSource, name: str = "batch") -> BatchRewrite:
    """Make a fixed leading batch dim symbolic, and fix the constants that bake it in.

    Handles models from old exporters: initializers listed as graph inputs are removed from
    the inputs; Reshape shape constants (initializers or Constant nodes) whose first entry is
    the batch are rewritten where shape inference proves it (to 0 when the Reshape's input
    carries the batch as dim 0, to -1 when its input holds the batch once among fixed dims);
    ``Flatten(axis=0)`` at batch 1 becomes ``Flatten(axis=1)``. Constants that may hold the
    batch but cannot be proven to (ConstantOfShape, Expand of a batch-less tensor, unprovable
    Reshapes) are listed in ``unproven``, not changed.
    """
    proto = _copy(source)
    rewritten: list[str] = []
    dropped = _drop_initializer_inputs(proto)
    if dropped:
        rewritten.append(f"{dropped} initializer(s) removed from the graph inputs")
    batch = _fixed_batch(proto)
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
            changed, unproven = _rewrite_round(proto, batch, name, done)
            rewritten += changed
            if not changed:
                break
    for line in rewritten:
        log.info("make_batch_dynamic: %s", line)
    for line in unproven:
        log.warning("make_batch_dynamic: %s", line)
    return BatchRewrite(proto, batch, tuple(rewritten), tuple(unproven))


def make_batch_dynamic(source: ModelSource, name: str = "batch") -> onnx.ModelProto:
    """Rewrite a fixed leading batch dim of inputs and outputs to the symbolic dim ``name``.

    See :func:`rewrite_batch` for what is rewritten; what could not be proven is logged as a
    warning. Run :func:`lint_batch` on the result to confirm every output follows the batch.
    """
    return rewrite_batch(source, name).model


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
    source: ModelSource, sizes: tuple[int, int] = (1, 3), dims: Mapping[str, int] | None = None
) -> list[LintIssue]:
    """Run the model at two batch sizes on ONNX Runtime CPU; report outputs that did not follow.

    Returns an empty list when every output's leading dim equals the batch size at both sizes.

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
