"""Opset conversion with ``onnx.version_converter``, carrying ops it has no adapter for."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import onnx

from enginekit.errors import ModelError
from enginekit.model import ModelSource
from enginekit.passes.graph import _copy, _graphs, _opset

log = logging.getLogger("enginekit.passes")


def _has_schema(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def convert_opset(source: ModelSource, opset: int) -> onnx.ModelProto:
    """The model converted to ai.onnx ``opset`` with ``onnx.version_converter``.

    The converter lacks many downgrade adapters for ops whose newer version only widened the
    types it accepts (Add 14 -> 13, Identity 16 -> 14). Such an op, when its inputs, outputs
    and attributes are the same at both versions, is carried over unchanged and its types are
    then checked against the older schema; the op list is recorded as ``carried``.

    Raises:
        ModelError: naming the model's opset, the target, and the op that cannot be converted.
    """
    return _convert(_copy(source), opset)[0]


def _convert(proto: onnx.ModelProto, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    current = _opset(proto)
    if current == opset:
        return proto, []
    newest = onnx.defs.onnx_opset_version()
    if not 1 <= opset <= newest:
        raise ModelError(
            f"cannot convert the model from opset {current} to {opset}: onnx {onnx.__version__} "
            f"knows opsets 1..{newest}"
        )
    ops = {n.op_type for g in _graphs(proto.graph) for n in g.node if n.domain in ("", "ai.onnx")}
    missing = sorted(op for op in ops if not _has_schema(op, opset))
    if missing:
        raise ModelError(
            f"cannot convert the model from opset {current} to {opset}: op(s) "
            f"{', '.join(missing)} do not exist at opset {opset}. Export the model at opset "
            f"{opset} or lower from its framework, or use a backend that accepts opset {current}"
        )
    carried: list[str] = []
    while True:
        try:
            out = onnx.version_converter.convert_version(_hide(proto, carried), opset)
            break
        except Exception as exc:
            text = " ".join(str(exc).split())
            found = re.search(r"No Adapter (?:From|To) Version \$\d+ for (\w+)", text)
            op = found.group(1) if found else None
            if op and op not in carried and _same_signature(op, current, opset):
                carried.append(op)
                continue
            culprit = op or next((o for o in sorted(ops) if re.search(rf"\b{o}\b", text)), None)
            which = f": op {culprit!r} has no conversion" if culprit else ""
            raise ModelError(
                f"cannot convert the model from opset {current} to {opset}{which} ({text}). "
                f"Export the model at opset {opset} from its framework instead"
            ) from None
    out = _unhide(out, carried)
    if carried:
        _check_types(out, carried, current, opset)
    # Never lower the IR version (the model may use newer IR features); raise it if needed.
    needed = onnx.helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
    out.ir_version = max(proto.ir_version, needed)
    return out, carried


_CARRY = "enginekit.carry"  # a private domain the converter leaves alone


def _same_signature(op: str, a: int, b: int) -> bool:
    def formals(s: Any) -> tuple[Any, ...]:
        return (
            [(f.name, f.option) for f in s.inputs],
            [(f.name, f.option) for f in s.outputs],
            sorted((k, v.type) for k, v in s.attributes.items()),
        )

    return formals(onnx.defs.get_schema(op, a, "")) == formals(onnx.defs.get_schema(op, b, ""))


def _hide(proto: onnx.ModelProto, ops: Sequence[str]) -> onnx.ModelProto:
    if not ops:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for g in _graphs(out.graph):
        for n in g.node:
            if n.domain in ("", "ai.onnx") and n.op_type in ops:
                n.domain = _CARRY
    out.opset_import.append(onnx.helper.make_opsetid(_CARRY, 1))
    return out


def _unhide(proto: onnx.ModelProto, ops: Sequence[str]) -> onnx.ModelProto:
    if not ops:
        return proto
    for g in _graphs(proto.graph):
        for n in g.node:
            if n.domain == _CARRY:
                n.domain = ""
    keep = [o for o in proto.opset_import if o.domain != _CARRY]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    return proto


def _check_types(proto: onnx.ModelProto, carried: Sequence[str], current: int, opset: int) -> None:
    """Type-check carried ops against their older schema (e.g. bfloat16 Add is not opset 13)."""
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as exc:
        text = " ".join(str(exc).split())
        op = next((o for o in carried if re.search(rf"\b{o}\b", text)), None)
        if op is not None:
            raise ModelError(
                f"cannot convert the model from opset {current} to {opset}: op {op!r} uses "
                f"types its opset-{opset} version does not accept ({text})"
            ) from None
        log.info("type check after opset conversion inconclusive: %s", text)
