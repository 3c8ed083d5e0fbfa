"""The rewrites :func:`enginekit.passes.batch.rewrite_batch` makes, one rule per pattern.

Each round proves which tensors carry the batch as dim 0 (:mod:`batch_proof`), then walks the
nodes once:

- **Reshape** with a constant shape (an initializer, a Constant node, or the first piece of a
  Concat that builds the shape) starting with the fixed batch: to ``0`` (copy dim 0) when its
  data input is a proven carrier, to ``-1`` when its input holds the batch once among fixed dims
  (the global-pooling ``[1, N]`` and channel-shuffle ``[1, g, c/g, h, w]`` patterns);
- **Flatten(axis=0)** at batch 1 on a carrier: ``axis=1``;
- **Concat** away from axis 0 joining a carrier and another tensor: the other's dim 0 must be
  the batch too, which proves an ``Expand``/``Tile``/``ConstantOfShape`` constant feeding it
  (rewritten to read the batch from the carrier), or, at batch 1, a batch-less tensor (a class
  token) that is expanded to the batch;
- anything else that bakes the batch in and cannot be proven is reported, by node name.

A round that changes the graph ends early: the next round proves again from scratch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.passes.batch_proof import (
    Dims,
    Placement,
    carriers,
    onnx_dims,
    ort_dims,
    placements,
    reshape_placement,
)

#: The sources of batch proofs, most trusted first (see :mod:`enginekit.passes.batch_proof`);
#: ``layout`` follows the batch into any axis (folded into attention heads) by memory layout.
PROVERS = ("onnx", "ort-symbolic", "batch-axis", "layout")

Setter = Callable[[np.ndarray], None]


def constants(proto: onnx.ModelProto) -> dict[str, tuple[np.ndarray, Setter]]:
    """Constant tensors by name: their value and a setter that rewrites them in place."""
    found: dict[str, tuple[np.ndarray, Setter]] = {}
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


def _uses(proto: onnx.ModelProto, name: str) -> int:
    return sum(i == name for n in proto.graph.node for i in n.input)


def _fresh(proto: onnx.ModelProto, name: str) -> str:
    taken = {t.name for t in proto.graph.initializer} | {
        o for n in proto.graph.node for o in n.output
    }
    out, i = name, 0
    while out in taken:
        i += 1
        out = f"{name}_{i}"
    return out


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def label(node: onnx.NodeProto) -> str:
    """``Op 'name'`` (the first output's name when the node has none)."""
    return f"{node.op_type} {node.name or node.output[0]!r}"


@dataclasses.dataclass
class Round:
    """What one round over the graph knows: shapes, carriers of the batch, constants."""

    proto: onnx.ModelProto
    batch: int
    sym: str
    dims: dict[str, Dims]
    proof: dict[str, str]
    consts: dict[str, tuple[np.ndarray, Setter]]
    producer: dict[str, onnx.NodeProto]
    static: dict[str, Dims]
    where: dict[str, Placement]

    @classmethod
    def of(
        cls,
        proto: onnx.ModelProto,
        batch: int,
        sym: str,
        provers: Sequence[str],
        static: dict[str, Dims],
    ) -> Round:
        sources = []
        if "onnx" in provers:
            sources.append(("onnx", onnx_dims(proto)))
        if "ort-symbolic" in provers:
            sources.append(("ort-symbolic", ort_dims(proto)))
        dims: dict[str, Dims] = {}
        for _, found in sources:
            for k, v in found.items():
                dims.setdefault(k, v)
        consts = constants(proto)
        for name, (value, _) in consts.items():
            dims.setdefault(name, tuple(int(d) for d in value.shape))
        proof = carriers(proto, sym, *sources)
        if "batch-axis" not in provers:
            proof = {k: v for k, v in proof.items() if v != "batch-axis"}
        producer = {o: n for n in proto.graph.node for o in n.output if o}
        where = placements(proto, sym, static) if "layout" in provers and batch == 1 else {}
        return cls(proto, batch, sym, dims, proof, consts, producer, static, where)

    def const(self, name: str) -> np.ndarray | None:
        found = self.consts.get(name)
        return None if found is None else found[0]

    def set_const(self, node: onnx.NodeProto, index: int, value: np.ndarray) -> None:
        """Give input ``index`` of ``node`` the constant ``value`` (a fresh one when shared)."""
        name = node.input[index]
        if _uses(self.proto, name) > 1:
            fresh = _fresh(self.proto, f"{name}__batch_dynamic")
            self.proto.graph.initializer.append(numpy_helper.from_array(value, fresh))
            node.input[index] = fresh
        else:
            self.consts[name][1](value)

    def add_const(self, name: str, value: np.ndarray) -> str:
        fresh = _fresh(self.proto, name)
        self.proto.graph.initializer.append(numpy_helper.from_array(value, fresh))
        return fresh

    def insert(self, before: onnx.NodeProto, *nodes: onnx.NodeProto) -> None:
        at = list(self.proto.graph.node).index(before)
        for offset, n in enumerate(nodes):
            self.proto.graph.node.insert(at + offset, n)

    def batch_of(self, carrier: str, before: onnx.NodeProto) -> str:
        """A 1-D tensor ``[batch]`` read from dim 0 of ``carrier``, computed before ``before``."""
        base = _fresh(self.proto, f"{carrier}__batch")
        zero = self.add_const(f"{base}_index", np.array([0], np.int64))
        self.insert(
            before,
            onnx.helper.make_node("Shape", [carrier], [f"{base}_shape"], name=f"{base}_shape"),
            onnx.helper.make_node("Gather", [f"{base}_shape", zero], [base], name=base, axis=0),
        )
        return base


def _shape_constant(r: Round, node: onnx.NodeProto, index: int) -> tuple[Any, int] | None:
    """Where a shape input's first entry is a constant: (the node and input holding it, index)
    — the shape input itself, or the first piece of a Concat that builds it."""
    name = node.input[index]
    if r.const(name) is not None:
        return node, index
    concat = r.producer.get(name)
    if concat is not None and concat.op_type == "Concat" and concat.input:
        first = r.const(concat.input[0])
        if first is not None and first.ndim == 1 and len(first):
            return concat, 0
    return None


def _batch_once(src: Dims, sym: str) -> bool:
    return sum(d == sym for d in src) == 1 and all(isinstance(d, int) for d in src if d != sym)


def _no_wildcards(values: np.ndarray, allowzero: bool) -> bool:
    rest = values[1:].tolist()
    return -1 not in rest and (allowzero or 0 not in rest)


def reshape(r: Round, node: onnx.NodeProto) -> str | None:
    """Make a Reshape's constant leading batch dynamic: the change made, ``unproven:`` and the
    reason, or None when the Reshape does not bake the batch in."""
    where = _shape_constant(r, node, 1)
    if where is None:
        return None
    holder, index = where
    values = r.consts[holder.input[index]][0]
    if values.ndim != 1 or not len(values) or values[0] != r.batch:
        return None
    if holder is node and len(values) == 1:
        return None  # a 1-D target: shape arithmetic, or a whole-tensor flatten
    allowzero = any(a.name == "allowzero" and a.i == 1 for a in node.attribute)
    proof = r.proof.get(node.input[0])
    new = values.astype(np.int64).copy()
    src = r.dims.get(node.input[0])
    if proof and not allowzero:
        new[0] = 0  # copy the input's dim 0, which is the batch
    elif holder is node and src and _batch_once(src, r.sym) and _no_wildcards(values, allowzero):
        # The input holds the batch once among fixed dims: its size is batch * K and the
        # other entries fix K, so -1 recovers the batch.
        new[0] = -1
        proof = "shape inference"
    else:
        return (
            f"unproven:{label(node)}: constant shape {values.tolist()} starts with the batch "
            f"size {r.batch}, but nothing proves its data input {node.input[0]!r} carries the "
            f"batch as dim 0 (inferred shape: {src or 'unknown'})"
        )
    r.set_const(holder, index, new)
    piece = "" if holder is node else f" (first piece of {label(holder)})"
    return f"{label(node)}: shape {values.tolist()}{piece} -> {new.tolist()} (proof: {proof})"


def _ints(dims: Dims | None) -> tuple[int, ...] | None:
    if dims and all(isinstance(d, int) for d in dims):
        return tuple(int(d) for d in dims)  # type: ignore[arg-type]
    return None


def layout(r: Round, node: onnx.NodeProto) -> str | None:
    """A Reshape of a tensor holding the batch in any axis (``[seq, b*heads, d]``), whose
    constant shape bakes batch 1 in: the batch's axis in the output (by memory layout, as the
    outermost factor it can be) becomes ``-1``, every other entry its size at batch 1."""
    at = r.where.get(node.input[0])
    src = _ints(r.static.get(node.input[0]))
    out = _ints(r.static.get(node.output[0]))
    values = r.const(node.input[1])
    if at is None or src is None or out is None or values is None or values.ndim != 1:
        return None
    placed = reshape_placement(src, at, out)
    if placed is None or len(values) != len(out):
        return None
    j, _ = placed
    new = np.array(out, np.int64)
    new[j] = -1
    copies_batch = values[j] == 0 and (j, placed[1]) == at
    if np.array_equal(values, new) or copies_batch:
        return None
    r.set_const(node, 1, new)
    return (
        f"{label(node)}: shape {values.tolist()} -> {new.tolist()} (proof: layout — the batch "
        f"sits in axis {at[0]} of its input {node.input[0]!r} and lands in axis {j})"
    )


def flatten(r: Round, node: onnx.NodeProto) -> str | None:
    """At batch 1, Flatten(axis=0) equals Flatten(axis=1); only axis=1 follows the batch."""
    if _attr(node, "axis", 1) != 0 or r.batch != 1 or node.input[0] not in r.proof:
        return None
    for a in node.attribute:
        if a.name == "axis":
            a.i = 1
    return f"{label(node)}: axis 0 -> 1 (proof: {r.proof[node.input[0]]})"


#: Ops that make a tensor of a given shape: the input holding it, and the data input (if any).
_SHAPE_MAKERS: dict[str, tuple[int, int | None]] = {
    "Expand": (1, 0),
    "Tile": (1, 0),
    "ConstantOfShape": (0, None),
}


def concat_peer(r: Round, concat: onnx.NodeProto, index: int, carrier: str) -> str | None:
    """A Concat away from axis 0 joins the batch carrier ``carrier`` with input ``index``,
    whose dim 0 must then be the batch too. Make it so; the change made, or ``unproven:``."""
    name = concat.input[index]
    where = f"{label(concat)} input {name!r}"
    maker = r.producer.get(name)
    dims = r.dims.get(name)
    if not dims or not isinstance(dims[0], int):
        dims = r.static.get(name, dims)  # its shape in the fixed model
    if maker is not None and maker.op_type in _SHAPE_MAKERS:
        shape_at, data_at = _SHAPE_MAKERS[maker.op_type]
        values = r.const(maker.input[shape_at]) if len(maker.input) > shape_at else None
        data = r.dims.get(maker.input[data_at]) if data_at is not None else (1,)
        if (
            values is not None
            and values.ndim == 1
            and len(values)
            and values[0] == r.batch
            and data
            and data[0] == 1
        ):
            batch = r.batch_of(carrier, maker)
            rest = r.add_const(f"{maker.input[shape_at]}__rest", values[1:].astype(np.int64))
            shape = _fresh(r.proto, f"{maker.input[shape_at]}__batch_dynamic")
            r.insert(maker, onnx.helper.make_node("Concat", [batch, rest], [shape], axis=0))
            maker.input[shape_at] = shape
            what = "repeats" if maker.op_type == "Tile" else "shape"
            return (
                f"{label(maker)}: {what} {values.tolist()} -> [batch of {carrier!r}, "
                f"*{values[1:].tolist()}] (proof: it feeds {where}, beside a batch carrier)"
            )
    if r.batch == 1 and dims and dims[0] == 1:
        # A batch-less tensor (a class token, a constant) joined to the batch: broadcast it.
        batch = r.batch_of(carrier, concat)
        ones = r.add_const(f"{name}__ones", np.ones(len(dims) - 1, np.int64))
        shape = _fresh(r.proto, f"{name}__batch_shape")
        out = _fresh(r.proto, f"{name}__batch_expanded")
        r.insert(
            concat,
            onnx.helper.make_node("Concat", [batch, ones], [shape], axis=0),
            onnx.helper.make_node("Expand", [name, shape], [out], name=out),
        )
        concat.input[index] = out
        return f"{where}: dim 0 of 1 expanded to the batch of {carrier!r} (beside it)"
    return (
        f"unproven:{where}: joined along axis {_attr(concat, 'axis', 0)} to {carrier!r}, which "
        f"carries the batch, but its dim 0 ({dims[0] if dims else 'unknown'}) cannot be made "
        "the batch"
    )


def _bakes_batch(r: Round, node: onnx.NodeProto) -> str | None:
    """An Expand/Tile/ConstantOfShape constant that may be the batch, not proven either way."""
    at = {"Expand": 1, "Tile": 1, "ConstantOfShape": 0}.get(node.op_type)
    if at is None or len(node.input) <= at:
        return None
    values = r.const(node.input[at])
    if values is None or values.ndim != 1 or not len(values) or values[0] != r.batch:
        return None
    if node.op_type != "ConstantOfShape" and node.input[0] in r.proof:
        return None  # broadcasting / tiling a batch carrier keeps the batch
    src = r.dims.get(node.input[0]) if node.op_type != "ConstantOfShape" else None
    what = "repeats" if node.op_type == "Tile" else "shape"
    return (
        f"{label(node)}: constant {what} {values.tolist()} starts with the batch size "
        f"{r.batch}, but nothing proves it is the batch (data input shape: {src or 'unknown'})"
    )


def rewrite_round(
    proto: onnx.ModelProto,
    batch: int,
    sym: str,
    done: set[str],
    provers: Sequence[str],
    static: dict[str, Dims],
) -> tuple[list[str], list[str]]:
    """One round over the nodes: (changes made, what could not be proven).

    Args:
        static: every tensor's shape in the fixed model (before the batch was made symbolic).
    """
    r = Round.of(proto, batch, sym, provers, static)
    unproven: list[str] = []

    def changed(line: str | None, key: str) -> bool:
        if line is None:
            return False
        if line.startswith("unproven:"):
            unproven.append(line.removeprefix("unproven:"))
            return False
        done.add(key)
        return True

    for node in list(proto.graph.node):
        key = label(node)
        if key in done or not node.input:
            continue
        line = None
        if node.op_type == "Flatten":
            line = flatten(r, node)
        elif node.op_type == "Reshape" and len(node.input) > 1:
            line = reshape(r, node)
            if line is None or line.startswith("unproven:"):
                line = layout(r, node) or line
        if line is not None and changed(line, key):
            return [line], []
        if node.op_type == "Concat":
            rank = next((len(d) for i in node.input if (d := r.dims.get(i))), 0)
            axis = _attr(node, "axis", 0)
            carrier = next((i for i in node.input if i in r.proof), None)
            if not rank or carrier is None or axis % rank == 0:
                continue
            for index, name in enumerate(node.input):
                peer = f"{key} input {index}"
                if name and name not in r.proof and peer not in done:
                    line = concat_peer(r, node, index, carrier)
                    if line is not None and changed(line, peer):
                        return [line], []
        line = _bakes_batch(r, node)
        feeds_concat = any(
            node.output[0] in n.input for n in proto.graph.node if n.op_type == "Concat"
        )
        if line is not None and not feeds_concat:
            unproven.append(line)
    return [], unproven
