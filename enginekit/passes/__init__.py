"""ONNX graph preparation: simplification, opset conversion, subgraphs, renaming, dynamic batch.

:func:`prepare` is what ``build`` runs between loading the user's model and handing it to a
backend. Every pass it runs is recorded (name, node counts, seconds) in the artifact's manifest;
the build's source hash and its verification reference stay the user's own model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx

from enginekit.errors import BuildError, ModelError
from enginekit.model import Model, load_model
from enginekit.passes.batch import (
    BatchRewrite,
    LintIssue,
    lint_batch,
    make_batch_dynamic,
    rewrite_batch,
)
from enginekit.passes.graph import (
    SIMPLIFY_STEPS,
    _copy,
    count_nodes,
    extract,
    infer_shapes,
    rename,
    simplify,
)
from enginekit.passes.graph import simplify as _simplify  # prepare()'s argument shadows it
from enginekit.passes.opset import _convert, convert_opset

log = logging.getLogger(__name__)

#: onnxslim round-trips the model through protobuf, which cannot hold 2 GiB.
_MAX_SIMPLIFY_BYTES = (2 << 30) - (64 << 20)

__all__ = [
    "SIMPLIFY_STEPS",
    "BatchRewrite",
    "LintIssue",
    "PassRecord",
    "Prepared",
    "convert_opset",
    "count_nodes",
    "extract",
    "infer_shapes",
    "lint_batch",
    "make_batch_dynamic",
    "prepare",
    "rename",
    "rewrite_batch",
    "simplify",
]


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What one graph pass did, as ``manifest["passes"]`` records it."""

    name: str
    nodes_before: int
    nodes_after: int
    seconds: float
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": round(self.seconds, 4),
            **self.detail,
        }


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The result of :func:`prepare`.

    Attributes:
        reference: what verification compares against: the user's model (its subgraph when
            ``outputs`` were selected), untouched by simplification or opset conversion.
        model: what the backend builds.
        passes: every pass that ran, in order.
    """

    reference: Model
    model: Model
    passes: tuple[PassRecord, ...]


# -- the build's pipeline ----------------------------------------------------------------------


def _timed(
    name: str, fn: Callable[..., onnx.ModelProto], model: Model, *args: Any, **detail: Any
) -> tuple[Model, PassRecord]:
    start = time.perf_counter()
    proto = fn(model.proto, *args)
    seconds = time.perf_counter() - start
    out = load_model(proto)
    return out, PassRecord(name, count_nodes(model.proto), count_nodes(proto), seconds, detail)


def _slim_version() -> str:
    try:
        import onnxslim

        return f"onnxslim {onnxslim.__version__}"
    except ImportError:
        return "onnxslim (not installed)"


def prepare(
    model: Model,
    *,
    simplify: bool = True,
    outputs: Sequence[str] = (),
    opsets: tuple[int, int] | None = None,
) -> Prepared:
    """The graph passes of a build: subgraph selection, simplification, opset conversion.

    Simplification runs before the opset conversion: fewer ops reach onnx's version converter,
    whose downgrade adapters are incomplete (e.g. none for Identity from opset 16 down).

    Args:
        model: the user's model, as loaded.
        simplify: run :func:`simplify`; a failure there is logged and recorded, not raised
            (the unsimplified model is built instead).
        outputs: build only the subgraph computing these tensors (for debugging a mismatch).
        opsets: (min, max) ai.onnx opsets the backend accepts; the model is converted to the
            nearest one when outside.

    Raises:
        BuildError: a selected output does not exist, or the opset conversion is impossible.
    """
    records: list[PassRecord] = []
    reference = model
    if outputs:
        try:
            reference, rec = _timed("extract", extract, model, list(outputs))
        except ModelError as exc:
            raise BuildError(f"outputs={list(outputs)}: {exc}") from None
        records.append(dataclasses.replace(rec, detail={"outputs": list(outputs)}))
    current = reference
    if simplify and current.proto.ByteSize() > _MAX_SIMPLIFY_BYTES:
        n = count_nodes(current.proto)
        records.append(PassRecord("simplify", n, n, 0.0, {"skipped": "model over 2 GiB"}))
    elif simplify:
        detail = {"tool": _slim_version(), "steps": list(SIMPLIFY_STEPS)}
        start = time.perf_counter()
        try:
            current, rec = _timed("simplify", _simplify, current, **detail)
        except ModelError as exc:
            log.warning("%s: graph simplification skipped: %s", model.label, exc)
            n = count_nodes(current.proto)
            rec = PassRecord(
                "simplify", n, n, time.perf_counter() - start, {**detail, "error": str(exc)}
            )
        records.append(rec)
    if opsets is not None and not opsets[0] <= current.opset <= opsets[1]:
        target = min(max(current.opset, opsets[0]), opsets[1])
        try:
            start = time.perf_counter()
            proto, carried = _convert(_copy(current), target)
        except ModelError as exc:
            raise BuildError(
                f"{exc}; the backend accepts opsets {opsets[0]}..{opsets[1]}"
            ) from None
        conversion: dict[str, Any] = {"from": current.opset, "to": target, "carried": carried}
        rec = PassRecord(
            "convert_opset",
            count_nodes(current.proto),
            count_nodes(proto),
            time.perf_counter() - start,
            conversion,
        )
        current = load_model(proto)
        records.append(rec)
    for rec in records:
        log.info(
            "pass %s: %d -> %d nodes in %.3f s",
            rec.name,
            rec.nodes_before,
            rec.nodes_after,
            rec.seconds,
        )
    return Prepared(reference, current, tuple(records))
