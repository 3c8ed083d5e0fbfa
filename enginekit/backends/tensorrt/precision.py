"""The ONNX rewrites of a precision plan: fp16/bf16 conversion and the Q/DQ model for int8.

TensorRT 11 (and TensorRT 10 with strongly typed networks) takes every layer's precision from
the ONNX types, so reduced precision must be written into the model. ``to_low_precision``
converts float32 tensors to fp16 or bf16 and keeps the model's inputs and outputs float32, so
the engine's interface does not change. An op is converted only where its ONNX schema accepts
the low type; ops in ``fp32_ops`` and ops with a type attribute stay float32, with Casts at the
boundaries.

INT8 comes from a Q/DQ model made by calibration (the ``enginekit.calibration`` writers, or any
quantizer): ``quantized_model`` takes it from a callable or a file and checks it matches the
source model and what TensorRT accepts (zero points must be zero).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from enginekit.errors import BuildError

log = logging.getLogger(__name__)

#: Ops kept in fp32 by the fp16/bf16 rewrite unless ``fp32_ops`` says otherwise: reductions of
#: squares and powers overflow fp16's 65504 range long before their results do.
DEFAULT_FP32_OPS = ("Pow", "ReduceSumSquare", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp")

FLOAT: int = TensorProto.FLOAT
_LOW: dict[str, int] = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
_TYPE_NAME: dict[int, str] = {
    TensorProto.FLOAT16: "tensor(float16)",
    TensorProto.BFLOAT16: "tensor(bfloat16)",
}
_SUFFIX: dict[int, str] = {
    TensorProto.FLOAT: "fp32",
    TensorProto.FLOAT16: "fp16",
    TensorProto.BFLOAT16: "bf16",
}
_QDQ = ("QuantizeLinear", "DequantizeLinear")
#: Ops whose output type comes from an (optional) attribute, not from their inputs: never
#: converted, whatever their schema allows.
_SELF_TYPED = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "EyeLike",
     "Multinomial", "Bernoulli"}
)  # fmt: skip

#: A callable turning the source model into its Q/DQ model (the int8 integration point).
Quantizer = Callable[[onnx.ModelProto], onnx.ModelProto]
QdqSource = Quantizer | str | Path | onnx.ModelProto | None


def has_qdq(proto: onnx.ModelProto) -> bool:
    """Whether the main graph holds QuantizeLinear or DequantizeLinear nodes."""
    return any(n.op_type in _QDQ and n.domain in ("", "ai.onnx") for n in proto.graph.node)


# -- fp16 / bf16 -----------------------------------------------------------------------------------


def to_low_precision(
    proto: onnx.ModelProto, precision: str, fp32_ops: Sequence[str] | None = None
) -> onnx.ModelProto:
    """A copy of ``proto`` computing in fp16 or bf16, inputs and outputs still float32.

    Args:
        proto: the float32 model.
        precision: ``fp16`` or ``bf16``.
        fp32_ops: op types to keep in float32 (default: DEFAULT_FP32_OPS).

    Raises:
        BuildError: the model has control-flow subgraphs (If/Loop/Scan), or a tensor whose type
            ONNX shape inference cannot tell.
    """
    if precision not in _LOW:
        raise BuildError(f"low-precision rewrite: expected fp16 or bf16, got {precision!r}")
    low = _LOW[precision]
    for node in proto.graph.node:
        if any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        ):
            raise BuildError(
                f"node {node.name or node.op_type!r} ({node.op_type}) has a subgraph; the "
                f"{precision} rewrite handles graphs without control flow only. On TensorRT 10 "
                "build with strongly_typed=false (builder flags), or convert the model yourself "
                "(e.g. NVIDIA ModelOpt AutoCast) and build the converted model at fp32"
            )
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    types = _value_types(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    rewriter = _Rewriter(model, types, low)
    blocked = set(DEFAULT_FP32_OPS if fp32_ops is None else fp32_ops)
    for k, node in enumerate(model.graph.node):
        rewriter.plan_node(k, node, opset, blocked)
    rewriter.apply()
    return model


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # inference errors are many types; all mean the same here
        raise BuildError(f"ONNX shape inference failed on the model: {exc}") from None
    types: dict[str, int] = {}
    for v in (*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    for t in model.graph.initializer:
        types[t.name] = t.data_type
    return types


def _allowed_types(schema: Any, formal: Any) -> set[str]:
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return constraints.get(formal.type_str, {formal.type_str})


def _formal(params: Sequence[Any], index: int) -> Any | None:
    if index < len(params):
        return params[index]
    if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


class _Rewriter:
    """Decides per node which float inputs/outputs go low, then rewires with Casts."""

    def __init__(self, model: onnx.ModelProto, types: dict[str, int], low: int) -> None:
        self.model = model
        self.types = types
        self.low = low
        self.produced: dict[str, int] = {}  # value -> its type after the rewrite
        self.wanted: dict[tuple[int, int], int] = {}  # (node index, input index) -> type
        self.converted = 0

    def _type(self, name: str, node: onnx.NodeProto) -> int:
        if name not in self.types:
            raise BuildError(
                f"cannot tell the type of tensor {name!r} (used by {node.op_type} node "
                f"{node.name!r}); ONNX shape inference left it out. Run onnx.shape_inference or "
                "export with type information, or build on TensorRT 10 with builder flags"
            )
        return self.types[name]

    def plan_node(self, k: int, node: onnx.NodeProto, opset: int, blocked: set[str]) -> None:
        """Record the type node ``k`` wants for each input and gives each output."""
        convert = self._convertible(node, opset, blocked)
        schema = self._schema(node, opset) if convert else None
        for i, name in enumerate(node.input):
            if not name:
                continue
            have = self._type(name, node)
            want = have
            if convert and have == FLOAT:
                formal = _formal(schema.inputs, i) if schema is not None else None
                if node.op_type == "Cast" or (
                    formal is not None and _TYPE_NAME[self.low] in _allowed_types(schema, formal)
                ):
                    want = self.low
            self.wanted[(k, i)] = want
        for name in node.output:
            if name:
                have = self._type(name, node)
                self.produced[name] = self.low if convert and have == FLOAT else have
        if convert:
            self.converted += 1
            self._convert_attributes(node)

    def _schema(self, node: onnx.NodeProto, opset: int) -> Any:
        try:
            return onnx.defs.get_schema(node.op_type, opset, node.domain or "")
        except onnx.defs.SchemaError:
            return None

    def _convertible(self, node: onnx.NodeProto, opset: int, blocked: set[str]) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type in blocked:
            return False
        if node.op_type == "Cast":
            return any(a.name == "to" and a.i == FLOAT for a in node.attribute)
        if node.op_type in _SELF_TYPED or any(
            a.name in ("dtype", "to", "output_dtype") for a in node.attribute
        ):
            return False
        schema = self._schema(node, opset)
        if schema is None:
            return False
        float_outs = [
            (j, n) for j, n in enumerate(node.output) if n and self._type(n, node) == FLOAT
        ]
        if not float_outs:
            return False
        for j, _ in float_outs:
            formal = _formal(schema.outputs, j)
            if formal is None or _TYPE_NAME[self.low] not in _allowed_types(schema, formal):
                return False
        return True

    def _convert_attributes(self, node: onnx.NodeProto) -> None:
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            # The default value is a float32 zero; make the low type explicit.
            zero = numpy_helper.from_array(np.zeros(1, np.float32))
            node.attribute.append(helper.make_attribute("value", _low_tensor(zero, self.low, "")))
            return
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to":
                attr.i = self.low
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT:
                attr.t.CopyFrom(_low_tensor(attr.t, self.low, attr.t.name))
            elif node.op_type == "Constant" and attr.name in ("value_float", "value_floats"):
                values = [attr.f] if attr.name == "value_float" else list(attr.floats)
                array = np.asarray(values, np.float32)
                if attr.name == "value_float":
                    array = array.reshape(())
                tensor = _low_tensor(numpy_helper.from_array(array), self.low, "")
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", tensor))
                break

    def apply(self) -> None:
        graph = self.model.graph
        for v in graph.input:
            self.produced[v.name] = self.types.get(v.name, 0)
        initializers = {t.name: t for t in graph.initializer}
        for name in initializers:
            self.produced.setdefault(name, initializers[name].data_type)
        # Graph outputs keep their float32 type: the producer writes a renamed low value and
        # a final Cast restores the output's own name.
        alias: dict[str, str] = {}
        tail: list[onnx.NodeProto] = []
        for out in graph.output:
            if self.produced.get(out.name) == self.low and out.name not in initializers:
                low_name = f"{out.name}__{_SUFFIX[self.low]}"
                alias[out.name] = low_name
                self.produced[low_name] = self.low
                for node in graph.node:
                    for k, name in enumerate(node.output):
                        if name == out.name:
                            node.output[k] = low_name
                tail.append(_cast(low_name, out.name, FLOAT))
        casts: dict[tuple[str, int], str] = {}
        new_inits: list[onnx.TensorProto] = []
        head: list[onnx.NodeProto] = []
        for k, node in enumerate(graph.node):
            for i, name in enumerate(node.input):
                if not name or (k, i) not in self.wanted:
                    continue
                want = self.wanted[(k, i)]
                source = alias.get(name, name)
                have = self.produced.get(source, want)
                if have == want or {have, want} - {FLOAT, self.low}:
                    node.input[i] = source
                    continue
                key = (source, want)
                if key not in casts:
                    casts[key] = f"{source}__{_SUFFIX[want]}"
                    if source in initializers and have == FLOAT:
                        new_inits.append(_low_tensor(initializers[source], want, casts[key]))
                    else:
                        head.append(_cast(source, casts[key], want))
                node.input[i] = casts[key]
        graph.initializer.extend(new_inits)
        _drop_unused_initializers(self.model)
        nodes = _toposort([*head, *graph.node, *tail], graph)
        del graph.node[:]
        graph.node.extend(nodes)
        del graph.value_info[:]
        log.info(
            "%s rewrite: %d nodes converted, %d casts, %d initializers converted",
            _SUFFIX[self.low],
            self.converted,
            len(head) + len(tail),
            len(new_inits),
        )


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [source], [target], name=f"{target}__cast", to=to)


def _low_tensor(tensor: onnx.TensorProto, low: int, name: str) -> onnx.TensorProto:
    array = numpy_helper.to_array(tensor).astype(np.float32)
    if low == TensorProto.FLOAT16:
        limit = float(np.finfo(np.float16).max)
        if np.any(np.abs(array[np.isfinite(array)]) > limit):
            log.warning("tensor %r: values beyond fp16's range clipped to +-%g", name, limit)
        array = np.clip(array, -limit, limit).astype(np.float16)
        out = numpy_helper.from_array(array, name)
    else:
        # bf16 keeps float32's exponent: round to nearest even on the upper 16 bits.
        bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out = helper.make_tensor(
            name, TensorProto.BFLOAT16, array.shape, rounded.tobytes(), raw=True
        )
    return out


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {n for node in model.graph.node for n in node.input}
    used |= {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def _toposort(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    ready = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(nodes)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for node in pending:
            if all(n in ready for n in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            names = ", ".join(sorted({n for node in rest for n in node.input} - ready))
            raise BuildError(f"low-precision rewrite left inputs without producers: {names}")
        pending = rest
    return ordered


# -- int8: the Q/DQ model ----------------------------------------------------------------------------


def quantized_model(source: onnx.ModelProto, quantizer: QdqSource) -> onnx.ModelProto:
    """The Q/DQ model for an int8 build, from a quantize callable, a file or a ModelProto.

    This is where the calibration writers plug in: ``quantizer`` may be any callable taking the
    source ModelProto and returning its Q/DQ ModelProto (e.g. a CalibrationTable's Q/DQ writer).

    Raises:
        BuildError: no quantizer, or its model is not a valid Q/DQ version of ``source``.
    """
    if quantizer is None:
        if has_qdq(source):
            check_qdq(source, source)
            return source
        raise BuildError("int8 needs a Q/DQ model: pass qdq_model=<path> or a quantize callable")
    if isinstance(quantizer, onnx.ModelProto):
        qdq = quantizer
    elif isinstance(quantizer, (str, Path)):
        try:
            qdq = onnx.load_model(str(quantizer))
        except Exception as exc:
            raise BuildError(
                f"qdq_model {str(quantizer)!r}: not a readable ONNX model ({exc})"
            ) from None
    elif callable(quantizer):
        qdq = quantizer(source)
        if not isinstance(qdq, onnx.ModelProto):
            raise BuildError(
                f"the quantize callable returned {type(qdq).__name__}, expected an onnx.ModelProto"
            )
    else:
        raise BuildError(
            f"quantizer: expected a callable, a path or a ModelProto, got {quantizer!r}"
        )
    check_qdq(qdq, source)
    return qdq


def check_qdq(qdq: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """A Q/DQ model fit for TensorRT: has Q/DQ nodes, the source's inputs and outputs, only
    constant zero points of zero (TensorRT's quantization is symmetric).

    Raises:
        BuildError: naming the node or tensor at fault.
    """
    from enginekit.model import io_specs

    if not has_qdq(qdq):
        raise BuildError(
            "the Q/DQ model has no QuantizeLinear/DequantizeLinear nodes; it is not quantized"
        )
    want_in, want_out = io_specs(source)
    got_in, got_out = io_specs(qdq)
    for kind, want, got in (("inputs", want_in, got_in), ("outputs", want_out, got_out)):
        w = [str(s) for s in want]
        g = [str(s) for s in got]
        if w != g:
            raise BuildError(
                f"the Q/DQ model's {kind} {g} differ from the source model's {w}; quantize the "
                "same model you build"
            )
    constants = {t.name: t for t in qdq.graph.initializer}
    for node in qdq.graph.node:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value":
                    constants[node.output[0]] = a.t
    for node in qdq.graph.node:
        if node.op_type not in _QDQ or len(node.input) < 3 or not node.input[2]:
            continue
        zp = node.input[2]
        if zp not in constants:
            raise BuildError(
                f"{node.op_type} node {node.name!r}: zero point {zp!r} is computed at run time; "
                "TensorRT needs constant zero points of 0 (symmetric quantization)"
            )
        values = numpy_helper.to_array(constants[zp])
        if np.any(values.astype(np.int64) != 0):
            raise BuildError(
                f"{node.op_type} node {node.name!r}: zero point {zp!r} is not 0; TensorRT "
                "supports symmetric quantization only (quantize with symmetric activations and "
                "weights, e.g. ActivationSymmetric=True, WeightSymmetric=True)"
            )


def model_sha256(proto: onnx.ModelProto) -> str:
    """SHA-256 of a ModelProto's deterministic serialization (the calibration part of a key)."""
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
