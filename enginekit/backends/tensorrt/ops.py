"""The ONNX operators TensorRT's ONNX parser supports, kept as data, and the pre-build check.

Source: onnx-tensorrt ``docs/operators.md`` for TensorRT 10.15 ("supports operators in the
inclusive range of opset 9 to opset 24"), the newest operator table NVIDIA publishes; TensorRT
11's parser supports at least these. Update ``SOURCE_VERSION`` and the sets together.

The check runs on the model before any TensorRT call, so an unsupported op is reported in
seconds instead of failing a ten-minute build. It checks op types and the opset, plus the few
documented restrictions that can be read from the graph alone (Q/DQ zero points, MaxPool's
``Indices`` output, TopK ``sorted``); other restrictions are left to the parser.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.errors import BuildError

SOURCE = "https://github.com/onnx/onnx-tensorrt/blob/main/docs/operators.md"
SOURCE_VERSION = "10.15"
OPSET_RANGE = (9, 24)

#: ai.onnx ops the parser supports ("Y" in the support matrix).
SUPPORTED = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool
    BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant
    ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear
    Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
    GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual
    GridSample GroupNormalization GRU HammingWindow HannWindow Hardmax HardSigmoid HardSwish
    Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less
    LessOrEqual Log LogSoftmax Loop LpNormalization LpPool LRN LSTM MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
    ReverseSequence RMSNormalization RNN RoiAlign RotaryEmbedding Round ScaledTanh Scan Scatter
    ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
    Softplus Softsign SpaceToDepth Split Sqrt Squeeze STFT Sub Sum Tan Tanh TensorScatter
    ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)

#: ai.onnx ops the support matrix lists as unsupported ("N").
UNSUPPORTED = frozenset(
    """
    AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor CenterCropPad
    Col2Im Compress ConcatFromSequence ConvInteger Det DFT DynamicQuantizeLinear ImageDecoder
    MatMulInteger MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss
    Optional OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch
    SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
    SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer
    StringSplit TfIdfVectorizer Unique
    """.split()
)


@dataclasses.dataclass(frozen=True)
class OpProblem:
    """One reason TensorRT's parser would refuse a model."""

    op: str
    nodes: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        shown = ", ".join(repr(n) for n in self.nodes[:3])
        more = f" and {len(self.nodes) - 3} more" if len(self.nodes) > 3 else ""
        return f"{self.op} ({len(self.nodes)} node(s): {shown}{more}): {self.reason}"


def supported_ops() -> list[str]:
    """Every ai.onnx op type the parser supports, sorted."""
    return sorted(SUPPORTED)


def find_problems(proto: onnx.ModelProto) -> list[OpProblem]:
    """Everything in ``proto`` (subgraphs included) the parser's operator table refuses."""
    found: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    problems = []
    if opset is not None and not OPSET_RANGE[0] <= opset <= OPSET_RANGE[1]:
        problems.append(
            OpProblem(
                f"opset {opset}",
                (),
                f"TensorRT {SOURCE_VERSION}'s parser supports opsets {OPSET_RANGE[0]}-"
                f"{OPSET_RANGE[1]}; re-export at an opset in that range",
            )
        )
    constants = _constants(proto.graph)
    seen: collections.Counter[str] = collections.Counter()
    for node in _nodes(proto.graph):
        seen[node.op_type] += 1
        reason = _node_problem(node, constants)
        if reason:
            found[(reason, node.op_type)].append(node.name or f"#{seen[node.op_type]}")
    for (reason, op), nodes in found.items():
        problems.append(OpProblem(op, tuple(nodes), reason))
    return problems


def check_ops(proto: onnx.ModelProto) -> None:
    """Refuse a model TensorRT's ONNX parser cannot take, before building.

    Raises:
        BuildError: listing every unsupported op with its nodes, and what to do.
    """
    problems = find_problems(proto)
    if problems:
        raise BuildError(
            "TensorRT's ONNX parser would refuse this model:\n  "
            + "\n  ".join(str(p) for p in problems)
            + f"\n(operator table of TensorRT {SOURCE_VERSION}: {SOURCE}). Replace these ops, "
            "register TensorRT plugins for custom ones and build with check_ops=false, or use "
            "the onnxruntime backend with providers=['tensorrt', 'cuda'], which runs the "
            "unsupported parts on CUDA."
        )


def _nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for node in graph.node:
        out.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                out.extend(_nodes(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    out.extend(_nodes(g))
    return out


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value":
                    constants[node.output[0]] = a.t
    return constants


def _node_problem(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> str | None:
    if node.domain not in ("", "ai.onnx"):
        return (
            f"custom op of domain {node.domain!r}; the parser loads it only from a TensorRT "
            f"plugin registered as {node.op_type!r}"
        )
    op = node.op_type
    if op in UNSUPPORTED:
        return "not supported by TensorRT's ONNX parser"
    if op not in SUPPORTED:
        return f"not in TensorRT {SOURCE_VERSION}'s operator table (newer than the parser?)"
    if op in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
        zp = constants.get(node.input[2])
        if zp is None or np.any(numpy_helper.to_array(zp).astype(np.int64) != 0):
            return "zero point must be a constant 0 (TensorRT quantizes symmetrically)"
    if op == "MaxPool" and len(node.output) > 1 and node.output[1]:
        return "the Indices output is unsupported"
    if op == "TopK" and any(a.name == "sorted" and a.i == 0 for a in node.attribute):
        return "sorted must be 1"
    return None
