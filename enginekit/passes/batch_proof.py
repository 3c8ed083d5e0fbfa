"""Which tensors carry the batch as their dim 0: the proofs :func:`rewrite_batch` rests on.

Three sources, tried in this order and recorded per proof:

- ``onnx``: ONNX shape inference with the batch dim symbolic (dim 0 is the symbol);
- ``ort-symbolic``: ONNX Runtime's symbolic shape inference tool, which knows more ops (ORT's
  contrib ops, Resize with computed sizes) and merges more symbolic arithmetic;
- ``batch-axis``: where neither inferred a shape, dim 0 is followed through ops that keep it
  (elementwise, convolution, pooling, normalization, Transpose with ``perm[0] == 0``, Flatten,
  Concat and Softmax/reductions away from axis 0, ...): only the leading axis, not the shape.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx

from enginekit.passes.graph import infer_shapes

log = logging.getLogger("enginekit.passes")

Dims = tuple[int | str | None, ...]

#: Ops whose output keeps dim 0 of their first input (any attributes).
_KEEP_FIRST = frozenset(
    "Abs Acos Asin Atan BatchNormalization Cast Ceil Celu Clip Conv ConvTranspose Cos Dropout "
    "Elu Erf Exp Floor Gelu GlobalAveragePool GlobalLpPool GlobalMaxPool HardSigmoid HardSwish "
    "Identity InstanceNormalization IsInf IsNaN LRN LayerNormalization LeakyRelu Log LpPool "
    "MaxPool AveragePool MaxRoundPool Mish Neg Not PRelu QuantizeLinear DequantizeLinear "
    "Reciprocal Relu Round Selu Shrink Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Tan Tanh "
    "ThresholdedRelu Upsample Resize SpaceToDepth DepthToSpace GroupNormalization "
    "FastGelu BiasGelu SkipLayerNormalization QuickGelu".split()
)
#: Broadcasting ops: dim 0 of the output is the batch when an input of the highest rank has it.
_BROADCAST = frozenset(
    "Add Sub Mul Div Pow Max Min Sum Mean Where Equal Greater Less And Or Xor Mod "
    "GreaterOrEqual LessOrEqual BitShift".split()
)
#: Ops that keep dim 0 unless their axis attribute (default given) is 0.
_AXIS_OPS = {
    "Softmax": 1,
    "LogSoftmax": 1,
    "Hardmax": 1,
    "Concat": None,
    "Split": 0,
    "Gather": 0,
    "ArgMax": 0,
    "ArgMin": 0,
    "TopK": -1,
    "CumSum": None,
}
_REDUCE = frozenset(
    "ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
    "ReduceLogSumExp ReduceSumSquare".split()
)


def _dims_of(proto: onnx.ModelProto) -> dict[str, Dims]:
    dims: dict[str, Dims] = {}
    for v in list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output):
        t = v.type.tensor_type
        if t.HasField("shape"):
            dims[v.name] = tuple(
                d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                for d in t.shape.dim
            )
    return dims


def onnx_dims(proto: onnx.ModelProto) -> dict[str, Dims]:
    """Shapes by tensor name from ONNX shape inference (lenient)."""
    return _dims_of(infer_shapes(proto))


def ort_dims(proto: onnx.ModelProto) -> dict[str, Dims]:
    """Shapes by tensor name from ONNX Runtime's symbolic shape inference ({} where it fails)."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:  # an ORT build without its tools
        return {}
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    try:
        inferred = SymbolicShapeInference.infer_shapes(
            copy, auto_merge=True, guess_output_rank=False, verbose=0
        )
    except Exception as exc:  # it raises on ops it cannot infer; the other proofs remain
        log.info("ONNX Runtime symbolic shape inference failed: %s", exc)
        return {}
    return _dims_of(inferred) if inferred is not None else {}


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _keeps_axis0(
    node: onnx.NodeProto, carriers: set[str], dims: dict[str, Dims], consts: set[str]
) -> bool:
    """Whether the node's first output has the batch as dim 0, given the carriers so far."""
    inputs = [i for i in node.input if i]
    if not inputs:
        return False
    op = node.op_type
    first = inputs[0] in carriers
    if op in _KEEP_FIRST:
        return first
    if op in _BROADCAST:
        carried = [i for i in inputs if i in carriers]
        if not carried:
            return False
        rank = max(len(dims.get(i, ())) for i in carried)
        # Another input of higher rank would put its own dims in front.
        return all(i in carriers or len(dims.get(i, (0,) * 99)) <= rank for i in inputs)
    if op in ("MatMul", "Gemm", "MatMulInteger", "QLinearMatMul"):
        return first and ((op == "Gemm" and not _attr(node, "transA", 0)) or op != "Gemm")
    if op == "Flatten":
        return first and _attr(node, "axis", 1) >= 1
    if op == "Transpose":
        perm = _attr(node, "perm", None)
        return first and perm is not None and len(perm) > 0 and perm[0] == 0
    if op == "Reshape":
        return False  # its shape decides; the rewrite handles Reshape
    if op in _AXIS_OPS:
        axis = _attr(node, "axis", _AXIS_OPS[op])
        if op == "Concat":
            return any(i in carriers for i in inputs) and axis not in (0, None)
        return first and axis not in (0, None)
    if op in _REDUCE:
        axes = _attr(node, "axes", None)
        if axes is None and len(inputs) > 1 and inputs[1] in consts:
            return False  # axes as an input (opset 18): not followed here
        return first and axes is not None and 0 not in axes
    if op in ("Squeeze", "Unsqueeze"):
        axes = _attr(node, "axes", None)
        return first and axes is not None and 0 not in axes
    if op == "Pad":
        return first and len(inputs) == 1 and not _attr(node, "pads", [1])[0]
    if op == "Slice":
        return first and len(inputs) == 1 and 0 not in _attr(node, "axes", [0])
    return False


def carriers(
    proto: onnx.ModelProto, sym: str, *sources: tuple[str, dict[str, Dims]]
) -> dict[str, str]:
    """Tensors whose dim 0 is the batch, each with the source that proves it.

    Args:
        sources: ``(name, shapes)`` pairs from shape inference, most trusted first; their
            proofs come first, then ``batch-axis`` follows dim 0 where none of them has one.
    """
    proof: dict[str, str] = {}
    for v in proto.graph.input:  # the seeds: inputs whose dim 0 is the symbol
        dims = v.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == sym:
            proof[v.name] = "input"
    merged: dict[str, Dims] = {}
    for name, dims in sources:
        for tensor, d in dims.items():
            merged.setdefault(tensor, d)
            if d and d[0] == sym:
                proof.setdefault(tensor, name)
    consts = {t.name for t in proto.graph.initializer}
    consts |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    found = set(proof)
    for node in proto.graph.node:
        if not node.output or node.output[0] in found:
            continue
        known = [merged.get(o) for o in node.output if o]
        if any(k and k[0] is not None and k[0] != sym for k in known):
            continue  # inference knows dim 0 and it is not the batch
        if _keeps_axis0(node, found, merged, consts):
            for out in node.output[:1]:
                proof[out] = "batch-axis"
                found.add(out)
    return proof


#: Where the batch sits in a tensor: (axis, outer) — the axis holds ``outer * batch * inner``
#: elements, the batch between them (a batch folded into attention heads: ``[seq, b*heads, d]``).
Placement = tuple[int, int]


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def reshape_placement(
    src: tuple[int, ...], at: Placement, out: tuple[int, ...]
) -> Placement | None:
    """Where the batch lands when a tensor of (batch-1) shape ``src`` with the batch at ``at`` is
    reshaped to ``out``; None when the layouts do not line up.

    At batch 1 the layout leaves a choice: the batch can start the output axis that begins at
    its offset (``[17, b, 64] -> [17, 4b, 16]``, attention heads) or end the axis before it
    (``[17, b, 64] -> [17b, 64]``). The first is taken unless it would be the last axis (the
    features a MatMul contracts over), where the second is.
    """
    k, outer = at
    before = _prod(src[:k]) * outer  # elements (in row-major order) before the batch's block
    prefix = 1
    inside: Placement | None = None
    starts: Placement | None = None
    for j, d in enumerate(out):
        if prefix == before and starts is None:
            starts = (j, 1)
            break
        if before % prefix == 0:
            o = before // prefix
            if d % o == 0 and o <= d:
                inside = (j, o)
        prefix *= int(d)
        if prefix > before:
            break
    if starts is not None and (starts[0] < len(out) - 1 or inside is None):
        return starts
    return inside


def placements(proto: onnx.ModelProto, sym: str, static: dict[str, Dims]) -> dict[str, Placement]:
    """The batch's placement in every tensor it can be followed to, from the inputs (dim 0).

    Args:
        static: every tensor's shape at the model's fixed batch 1 (from shape inference on
            the fixed model), to follow the batch through Reshape and Flatten by layout.
    """
    where: dict[str, Placement] = {}
    for v in proto.graph.input:
        dims = v.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == sym:
            where[v.name] = (0, 1)
    from onnx import numpy_helper

    small: dict[str, Any] = {
        t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if len(t.dims) <= 1
    }
    for c in proto.graph.node:
        if c.op_type == "Constant":
            for a in c.attribute:
                if a.name == "value" and len(a.t.dims) <= 1:
                    small[c.output[0]] = numpy_helper.to_array(a.t)

    def axes_of(node: onnx.NodeProto) -> list[int]:
        """The axes attribute, or (opset 13+) the constant axes input."""
        axes = _attr(node, "axes", None)
        if axes is None and len(node.input) > 1 and node.input[1] in small:
            axes = small[node.input[1]].reshape(-1).tolist()
        return [int(a) for a in axes or []]

    def ints(name: str) -> tuple[int, ...] | None:
        d = static.get(name)
        if not d:
            return None
        found = [x for x in d if isinstance(x, int)]
        return tuple(found) if len(found) == len(d) else None

    for node in proto.graph.node:
        inputs = [i for i in node.input if i]
        carried = [i for i in inputs if i in where]
        if not carried or not node.output:
            continue
        op = node.op_type
        first = inputs[0]
        src = ints(first)
        out = ints(node.output[0])
        at: Placement | None = None
        if op in _KEEP_FIRST and first in where:
            at = where[first]
        elif op in _BROADCAST or op in ("Softmax", "LogSoftmax", "LayerNormalization"):
            k, o = where[carried[0]]
            rank_in, rank_out = len(ints(carried[0]) or ()), len(out or ())
            if op in _BROADCAST and rank_in and rank_out:
                k += rank_out - rank_in
            axis = _attr(node, "axis", -1)
            if op in ("Softmax", "LogSoftmax", "LayerNormalization") and rank_out:
                if axis % rank_out <= k:
                    continue  # normalized over the batch's axis: it no longer separates rows
            at = (k, o)
        elif op == "Transpose" and first in where:
            perm = list(_attr(node, "perm", []))
            if perm:
                at = (perm.index(where[first][0]), where[first][1])
        elif op in ("MatMul", "Gemm") and first in where and src:
            k, o = where[first]
            trans = op == "Gemm" and _attr(node, "transA", 0)
            if k < len(src) - 1 and not trans:
                at = (k, o)
        elif op in ("Reshape", "Flatten") and first in where and src and out:
            at = reshape_placement(src, where[first], out)
        elif op in ("Squeeze", "Unsqueeze", "ReduceMean", "ReduceSum", "ReduceMax") and src:
            k, o = where[first]
            axes = [a % max(len(src), 1) for a in axes_of(node)]
            if op == "Unsqueeze" and out:
                axes = [a % len(out) for a in axes_of(node)]
                for a in sorted(axes):
                    k += int(a <= k)
            elif k in axes or not axes:
                continue
            elif op == "Squeeze" or not _attr(node, "keepdims", 1):
                k -= sum(a < k for a in axes)
            at = (k, o)
        elif (op in ("Gather", "Slice", "Split") and first in where) or op == "Concat":
            k, o = where[first] if first in where else where[carried[0]]
            src = src if first in where else ints(carried[0])
            axis = _attr(node, "axis", 0)
            if op == "Slice":
                continue  # axes as inputs since opset 10: not followed
            if src and axis % len(src) == k:
                continue
            if op == "Gather" and src and out and len(out) < len(src):
                k -= int(axis % len(src) < k)
            at = (k, o)
        if at is not None:
            for name in node.output if op == "Split" else node.output[:1]:
                where[name] = at
    return where


#: Shape arithmetic that old exporters leave unfolded (``x.expand(n, -1, -1)`` with ``n``
#: baked in becomes ConstantOfShape -> Mul -> Equal -> Where): folded before proving.
_FOLDABLE = frozenset(
    "Add Sub Mul Div Equal Where ConstantOfShape Concat Unsqueeze Squeeze Gather Slice Cast "
    "Reshape Range Mod Neg Abs Max Min Identity".split()
)
_FOLD_MAX_ELEMENTS = 64


def fold_shape_constants(proto: onnx.ModelProto) -> int:
    """Replace small constant-only shape computations by initializers, in place.

    Only nodes whose every input is a constant and whose outputs are small integer tensors
    (shapes, never weights): nothing that depends on the model's inputs changes. Returns how
    many nodes were folded.
    """
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    values: dict[str, Any] = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    folded = []
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(a.t)
                elif a.name in ("value_ints", "value_int"):
                    values[node.output[0]] = np.array(onnx.helper.get_attribute_value(a), np.int64)
            continue
        inputs = [i for i in node.input if i]
        if node.op_type not in _FOLDABLE or not all(i in values for i in inputs):
            continue
        if any(np.asarray(values[i]).size > _FOLD_MAX_ELEMENTS for i in inputs):
            continue
        try:
            graph = onnx.helper.make_graph(
                [node], "fold", [], [onnx.ValueInfoProto(name=o) for o in node.output],
                [numpy_helper.from_array(np.asarray(values[i]), i) for i in dict.fromkeys(inputs)],
            )  # fmt: skip
            model = onnx.helper.make_model(graph, opset_imports=proto.opset_import)
            outs = ReferenceEvaluator(model).run(None, {})
        except Exception:  # an op the reference evaluator cannot run: leave it
            continue
        if any(
            np.asarray(o).dtype.kind not in "iub" or np.asarray(o).size > _FOLD_MAX_ELEMENTS
            for o in outs
        ):
            continue
        for name, out in zip(node.output, outs):
            values[name] = np.asarray(out)
        folded.append(node)
    if not folded:
        return 0
    used = {i for n in proto.graph.node if n not in folded for i in n.input}
    used |= {o.name for o in proto.graph.output}
    for node in folded:
        proto.graph.node.remove(node)
        for name in node.output:
            if name in used:
                proto.graph.initializer.append(numpy_helper.from_array(values[name], name))
    return len(folded)
