"""fp16 and bf16 models by conversion of a float32 ONNX model.

Inputs and outputs stay float32 unless asked (``keep_io_types=False``); numerically sensitive
ops (reductions, exp/log/pow, softmax, normalizations) stay float32 with Casts around them.

- fp16: ONNX Runtime's converter (``onnxruntime.transformers.float16``), which handles
  subgraphs and ORT's kernel coverage; we only add the sensitive ops to its block list.
- bf16: written here (ORT has no bf16 converter). A node computes in bf16 only where the ONNX
  schema of its op, at the model's opset, allows ``tensor(bfloat16)`` for every float input and
  output (so Conv, whose schema has no bf16, stays float32); main graph only.

What runs where (measured, ONNX Runtime 1.32 CPU): fp16 models run, but the CPU provider
computes most ops by casting back to float32 (no speed-up); bf16 models do not run at all (no
bf16 kernels for MatMul, Gemm, Add, Relu, ...). See docs/calibration.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from enginekit.errors import BuildError

#: Ops kept in float32 in fp16/bf16 models: large reductions and transcendental functions lose
#: most in 16-bit floats (the same set TensorRT's mixed precision keeps in fp32 by default).
FP32_OPS = (
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "Softmax", "LogSoftmax", "Exp", "Log", "Pow", "Sqrt",
    "Reciprocal", "Erf", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "BatchNormalization", "CumSum", "Range", "TopK", "NonMaxSuppression", "RoiAlign", "Resize",
)  # fmt: skip


def to_fp16(
    model: onnx.ModelProto, keep_io_types: bool = True, fp32_ops: Sequence[str] = FP32_OPS
) -> onnx.ModelProto:
    """An fp16 copy of a float32 model (ONNX Runtime's converter, our fp32 op list)."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    try:
        return convert_float_to_float16(
            proto,
            keep_io_types=keep_io_types,
            op_block_list=sorted(set(DEFAULT_OP_BLOCK_LIST) | set(fp32_ops)),
        )
    except Exception as exc:
        raise BuildError(f"converting the model to fp16 failed: {exc}") from None


#: Ops worth computing in 16 bits on their own; others follow their producers.
HEAVY_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention")


@functools.lru_cache(maxsize=512)
def _allows(op: str, domain: str, opset: int, dtype: str) -> bool:
    """Whether every type constraint that takes float32 in ``op``'s schema also takes ``dtype``."""
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return False
    floats = [c for c in schema.type_constraints if "tensor(float)" in c.allowed_type_strs]
    return bool(floats) and all(dtype in c.allowed_type_strs for c in floats)


def to_bf16(
    model: onnx.ModelProto, keep_io_types: bool = True, fp32_ops: Sequence[str] = FP32_OPS
) -> onnx.ModelProto:
    """A bf16 copy of a float32 model: bf16 wherever the op's schema allows it.

    Float32 initializers used only by bf16 nodes are stored in bf16; a tensor crossing between
    a float32 and a bf16 node gets one Cast, shared by all its consumers.
    """
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:
        raise BuildError(
            f"bf16 conversion needs the tensor types: shape inference failed: {exc}"
        ) from None
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in list(inferred.graph.value_info) + list(graph.input) + list(graph.output)
    }
    for t in graph.initializer:
        types[t.name] = t.data_type
    blocked = set(fp32_ops)

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name) == TensorProto.FLOAT

    # A cheap op goes bf16 only when fed by a bf16 op: else it would only add Casts.
    low = set()
    in_bf16 = set() if keep_io_types else {v.name for v in graph.input}
    for i, node in enumerate(graph.node):
        floats = [t for t in list(node.input) + list(node.output) if is_float(t)]
        if (
            floats
            and node.op_type not in blocked
            and node.domain in ("", "ai.onnx")
            and node.op_type not in ("Cast", "CastLike", "Constant")
            and (node.op_type in HEAVY_OPS or any(t in in_bf16 for t in node.input))
            and _allows(node.op_type, "", opset, "tensor(bfloat16)")
        ):
            low.add(i)
            in_bf16.update(o for o in node.output if is_float(o))
    dtype = {n: TensorProto.FLOAT for n in types if is_float(n)}
    if not keep_io_types:
        for v in graph.input:
            if is_float(v.name):
                dtype[v.name] = TensorProto.BFLOAT16
                v.type.tensor_type.elem_type = TensorProto.BFLOAT16
    # Initializers read only by bf16 nodes are converted in place.
    readers: dict[str, set[bool]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, set()).add(i in low)
    for t in graph.initializer:
        if t.data_type == TensorProto.FLOAT and readers.get(t.name) == {True}:
            t.CopyFrom(_bf16_tensor(t))
            dtype[t.name] = TensorProto.BFLOAT16
    casts: dict[tuple[str, int], str] = {}
    nodes: list[onnx.NodeProto] = []

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}__to_{'bf16' if to == TensorProto.BFLOAT16 else 'fp32'}"
            nodes.append(helper.make_node("Cast", [name], [casts[key]], to=to))
        return casts[key]

    for i, node in enumerate(graph.node):
        want = TensorProto.BFLOAT16 if i in low else TensorProto.FLOAT
        for k, name in enumerate(node.input):
            if name in dtype and dtype[name] != want:
                node.input[k] = cast(name, want)
        if i in low:
            dtype.update((o, TensorProto.BFLOAT16) for o in node.output if is_float(o))
        nodes.append(node)
    # Graph outputs keep their float32 type: cast back under the original name.
    for v in graph.output:
        if dtype.get(v.name) == TensorProto.BFLOAT16:
            if keep_io_types:
                inner = f"{v.name}__bf16"
                for node in nodes:
                    node.output[:] = [inner if o == v.name else o for o in node.output]
                    node.input[:] = [inner if o == v.name else o for o in node.input]
                nodes.append(helper.make_node("Cast", [inner], [v.name], to=TensorProto.FLOAT))
            else:
                v.type.tensor_type.elem_type = TensorProto.BFLOAT16
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return proto


def _bf16_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    import ml_dtypes

    a = numpy_helper.to_array(t).astype(np.float32)
    bits = a.astype(ml_dtypes.bfloat16).view(np.uint16)
    out = helper.make_tensor(t.name, TensorProto.BFLOAT16, a.shape, bits.tobytes(), raw=True)
    return out


def strip_qdq(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """The float graph of a Q/DQ (quantization-aware) model: every QuantizeLinear ->
    DequantizeLinear pair on an activation removed, every DequantizeLinear of a constant weight
    folded into the float weight it stands for. None when that cannot be derived (a Q/DQ node
    used another way: a QuantizeLinear output that feeds something else, a DequantizeLinear of a
    computed tensor).
    """
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    alias: dict[str, str] = {}  # tensor name -> the float tensor it equals
    folded: list[onnx.TensorProto] = []
    drop: set[int] = set()
    producers = {o: n for n in graph.node for o in n.output}
    for n in graph.node:
        if n.op_type == "QuantizeLinear":
            users = consumers.get(n.output[0], [])
            if not users or any(u.op_type != "DequantizeLinear" for u in users):
                return None
            drop.add(id(n))
            for u in users:
                drop.add(id(u))
                alias[u.output[0]] = n.input[0]
        elif n.op_type == "DequantizeLinear" and id(n) not in drop:
            if n.input[0] in producers or n.input[0] not in inits:
                return None  # dequantizes a computed tensor: no float original to recover
            q = numpy_helper.to_array(inits[n.input[0]]).astype(np.float32)
            scale = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
            zero = (
                numpy_helper.to_array(inits[n.input[2]]).astype(np.float32)
                if len(n.input) > 2 and n.input[2]
                else np.zeros_like(scale)
            )
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            if scale.ndim == 1 and q.ndim > 1:
                shape = [1] * q.ndim
                shape[axis] = -1
                scale, zero = scale.reshape(shape), zero.reshape(shape)
            folded.append(numpy_helper.from_array((q - zero) * scale, n.output[0]))
            drop.add(id(n))

    def resolve(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    kept = [n for n in graph.node if id(n) not in drop]
    for n in kept:
        for i, name in enumerate(n.input):
            n.input[i] = resolve(name)
    outputs = {o.name for o in graph.output}
    for o in list(graph.output):
        real = resolve(o.name)
        if real != o.name:  # a graph output that was a DQ: keep its name through an Identity
            kept.append(onnx.helper.make_node("Identity", [real], [o.name]))
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in kept for i in n.input} | outputs
    remaining = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(remaining + folded)
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError:
        return None
    return out
