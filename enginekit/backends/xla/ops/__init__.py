"""The ONNX -> JAX op table: one plain function per ONNX op, named after it.

Each function takes the node's inputs positionally (None for an omitted optional input) and its
attributes as keyword arguments with the ONNX spec's defaults. Attributes that later opsets
turned into inputs (Split's split, Squeeze's axes, Slice's starts, Pad's pads, Clip's min/max,
Reduce*'s axes) share the parameter name, so one function serves every opset. Where semantics
changed between opsets the table maps opset -> function (``{1: Softmax_1, 13: Softmax}``).

Importing this package imports jax; the backend module imports it lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from enginekit.backends.values import SHAPE_INPUTS
from enginekit.backends.xla.ops import (
    attention,
    control,
    extra,
    index,
    loop,
    loss,
    misc,
    nn,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    sample,
    state,
    tensor,
)
from enginekit.backends.xla.ops import elementwise as ew

OpFunction = Callable[..., Any]
Entry = OpFunction | dict[int, OpFunction]

OPS: dict[str, Entry] = {
    # unary math
    "Abs": ew.Abs,
    "Neg": ew.Neg,
    "Sqrt": ew.Sqrt,
    "Exp": ew.Exp,
    "Log": ew.Log,
    "Reciprocal": ew.Reciprocal,
    "Floor": ew.Floor,
    "Ceil": ew.Ceil,
    "Round": ew.Round,
    "Sign": ew.Sign,
    "Sin": ew.Sin,
    "Cos": ew.Cos,
    "Tan": ew.Tan,
    "Asin": ew.Asin,
    "Acos": ew.Acos,
    "Atan": ew.Atan,
    "Sinh": ew.Sinh,
    "Cosh": ew.Cosh,
    "Asinh": ew.Asinh,
    "Acosh": ew.Acosh,
    "Atanh": ew.Atanh,
    "Erf": ew.Erf,
    "IsNaN": ew.IsNaN,
    "IsInf": ew.IsInf,
    # activations
    "Relu": ew.Relu,
    "LeakyRelu": ew.LeakyRelu,
    "PRelu": {1: ew.PRelu_6, 7: ew.PRelu},
    "ThresholdedRelu": ew.ThresholdedRelu,
    "Elu": ew.Elu,
    "Selu": ew.Selu,
    "Celu": ew.Celu,
    "Sigmoid": ew.Sigmoid,
    "HardSigmoid": ew.HardSigmoid,
    "HardSwish": ew.HardSwish,
    "Tanh": ew.Tanh,
    "Softplus": ew.Softplus,
    "Softsign": ew.Softsign,
    "Mish": ew.Mish,
    "Gelu": ew.Gelu,
    # binary and variadic math
    "Add": ew.Add,
    "Sub": ew.Sub,
    "Mul": ew.Mul,
    "Div": ew.Div,
    "Pow": ew.Pow,
    "Mod": ew.Mod,
    "Max": ew.Max,
    "Min": ew.Min,
    "Sum": ew.Sum,
    "Mean": ew.Mean,
    "Clip": ew.Clip,
    # comparisons and logic
    "Equal": ew.Equal,
    "Less": ew.Less,
    "LessOrEqual": ew.LessOrEqual,
    "Greater": ew.Greater,
    "GreaterOrEqual": ew.GreaterOrEqual,
    "Not": ew.Not,
    "And": ew.And,
    "Or": ew.Or,
    "Xor": ew.Xor,
    "Where": ew.Where,
    # types
    "Cast": ew.Cast,
    "CastLike": ew.CastLike,
    "Identity": ew.Identity,
    # shape and data movement
    "Shape": tensor.Shape,
    "Size": tensor.Size,
    "Reshape": tensor.Reshape,
    "Flatten": tensor.Flatten,
    "Transpose": tensor.Transpose,
    "Squeeze": tensor.Squeeze,
    "Unsqueeze": tensor.Unsqueeze,
    "Concat": tensor.Concat,
    "Split": tensor.Split,
    "Slice": tensor.Slice,
    "Gather": tensor.Gather,
    "GatherElements": tensor.GatherElements,
    "GatherND": index.GatherND,
    "ScatterND": index.ScatterND,
    "ScatterElements": index.ScatterElements,
    "Scatter": index.Scatter,
    "Resize": {10: resize.Resize_10, 11: resize.Resize},
    "Upsample": {7: resize.Upsample_7, 9: resize.Upsample},
    "Expand": tensor.Expand,
    "Tile": tensor.Tile,
    "Pad": tensor.Pad,
    "ConstantOfShape": tensor.ConstantOfShape,
    "Range": tensor.Range,
    "Constant": tensor.Constant,
    "Trilu": tensor.Trilu,
    "DepthToSpace": tensor.DepthToSpace,
    "SpaceToDepth": tensor.SpaceToDepth,
    "EyeLike": tensor.EyeLike,
    # control flow
    "If": control.If,
    "Scan": {8: loop.Scan_8, 9: loop.Scan},
    "Loop": loop.Loop,
    # neural network
    "Conv": nn.Conv,
    "ConvTranspose": nn.ConvTranspose,
    "MaxPool": pool.MaxPool,
    "AveragePool": pool.AveragePool,
    "LpPool": pool.LpPool,
    "GlobalAveragePool": pool.GlobalAveragePool,
    "GlobalMaxPool": pool.GlobalMaxPool,
    "BatchNormalization": nn.BatchNormalization,
    "InstanceNormalization": nn.InstanceNormalization,
    "LayerNormalization": nn.LayerNormalization,
    "LpNormalization": nn.LpNormalization,
    "LRN": nn.LRN,
    "Gemm": nn.Gemm,
    "MatMul": nn.MatMul,
    "Einsum": nn.Einsum,
    "Softmax": {1: nn.Softmax_1, 13: nn.Softmax},
    "LogSoftmax": {1: nn.LogSoftmax_1, 13: nn.LogSoftmax},
    "Hardmax": {1: nn.Hardmax_1, 13: nn.Hardmax},
    "Dropout": nn.Dropout,
    # reductions
    "ReduceSum": reduce.ReduceSum,
    "ReduceMean": reduce.ReduceMean,
    "ReduceMax": reduce.ReduceMax,
    "ReduceMin": reduce.ReduceMin,
    "ReduceProd": reduce.ReduceProd,
    "ReduceL1": reduce.ReduceL1,
    "ReduceL2": reduce.ReduceL2,
    "ReduceSumSquare": reduce.ReduceSumSquare,
    "ReduceLogSum": reduce.ReduceLogSum,
    "ReduceLogSumExp": reduce.ReduceLogSumExp,
    "ArgMax": reduce.ArgMax,
    "ArgMin": reduce.ArgMin,
    "CumSum": reduce.CumSum,
    "TopK": reduce.TopK,
    # smaller ops of newer opsets and the test data
    "Shrink": extra.Shrink,
    "Swish": extra.Swish,
    "BitShift": extra.BitShift,
    "BitwiseAnd": extra.BitwiseAnd,
    "BitwiseOr": extra.BitwiseOr,
    "BitwiseXor": extra.BitwiseXor,
    "BitwiseNot": extra.BitwiseNot,
    "CumProd": extra.CumProd,
    "MeanVarianceNormalization": extra.MeanVarianceNormalization,
    "GroupNormalization": extra.GroupNormalization,
    "RMSNormalization": extra.RMSNormalization,
    "OneHot": extra.OneHot,
    "ReverseSequence": extra.ReverseSequence,
    # attention (opset 23+)
    "Attention": attention.Attention,
    "RotaryEmbedding": attention.RotaryEmbedding,
    # newer opsets' smaller ops
    "BitCast": misc.BitCast,
    "CenterCropPad": misc.CenterCropPad,
    "Col2Im": misc.Col2Im,
    "MaxUnpool": misc.MaxUnpool,
    "TensorScatter": misc.TensorScatter,
    "Det": misc.Det,
    "MatMulInteger": misc.MatMulInteger,
    "QLinearMatMul": misc.QLinearMatMul,
    "Compress": misc.Compress,
    "TfIdfVectorizer": misc.TfIdfVectorizer,
    # sampling
    "GridSample": sample.GridSample,
    "AffineGrid": sample.AffineGrid,
    "DeformConv": sample.DeformConv,
    # state-space and linear attention (opset 27)
    "CausalConvWithState": state.CausalConvWithState,
    "LinearAttention": state.LinearAttention,
    # recurrent
    "RNN": rnn.RNN,
    "GRU": rnn.GRU,
    "LSTM": rnn.LSTM,
    # losses
    "NegativeLogLikelihoodLoss": loss.NegativeLogLikelihoodLoss,
    "SoftmaxCrossEntropyLoss": loss.SoftmaxCrossEntropyLoss,
    # quantization
    "QuantizeLinear": quant.QuantizeLinear,
    "DequantizeLinear": quant.DequantizeLinear,
}
loop.TABLE.update(OPS)


def resolve(op_type: str, opset: int) -> OpFunction | None:
    """The function lowering ``op_type`` at ``opset``, or None when the op is not supported."""
    entry = OPS.get(op_type)
    if entry is None or callable(entry):
        return entry
    versions = [v for v in entry if v <= opset]
    return entry[max(versions)] if versions else None


def supported_ops() -> list[str]:
    """Every ONNX op (default domain) the lowering handles, sorted."""
    return sorted(OPS)


#: Inputs that must be known when the model is built (constants, initializers, or computed from
#: shapes only): XLA compiles static shapes, and these decide shapes or axes (the table is
#: shared with the TVM backend's value inputs).
STATIC_INPUTS: dict[str, tuple[int, ...]] = SHAPE_INPUTS
