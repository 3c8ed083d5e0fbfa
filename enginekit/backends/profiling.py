"""The record a backend's ``profile`` hook returns (one per kernel execution), and FLOP counts
from the kernel shapes backends report.

A backend that can profile defines::

    profile(artifact, feeds, runs, warmup) -> list[OpEvent]

running ``feeds`` ``warmup`` times unrecorded, then ``runs`` times recorded, with its own
profiler (ONNX Runtime's ``enable_profiling``, OpenVINO's performance counters, ...).
:func:`enginekit.evaluate.profile.profile` turns the events into the per-op table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One execution of one kernel.

    Attributes:
        name: the node's name in the backend's (optimized) graph.
        op: its op type as the backend calls it (``Conv``, ``FusedMatMul``, ``Convolution``).
        kernel: the implementation that ran (``brgconv_avx512_f32``; the provider for ORT).
        run: which recorded run (0 .. runs-1).
        start_us: start time in microseconds from the first recorded run's start (None when the
            backend reports durations only; the trace then lays kernels end to end).
        dur_us: duration in microseconds.
        flops: floating-point (or integer multiply-add) operations, where the shapes say.
    """

    name: str
    op: str
    kernel: str
    run: int
    dur_us: float
    start_us: float | None = None
    flops: float | None = None


def _prod(dims: Sequence[int]) -> int:
    return math.prod(int(d) for d in dims)


def matmul_flops(out_shape: Sequence[int], k: int) -> float:
    """2·K multiply-adds per output element."""
    return 2.0 * _prod(out_shape) * k


def conv_flops(out_shape: Sequence[int], weight_shape: Sequence[int]) -> float:
    """2 · (Cin/groups · kernel area) per output element (weight ``[Cout, Cin/g, k...]``)."""
    return 2.0 * _prod(out_shape) * _prod(weight_shape[1:])


#: Op types (ONNX Runtime's and OpenVINO's names) counted as matrix products or convolutions.
MATMUL_OPS = frozenset(
    {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "QLinearMatMul",
     "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "FullyConnected", "Attention"}
)  # fmt: skip
CONV_OPS = frozenset({"Conv", "FusedConv", "NhwcFusedConv", "QLinearConv", "ConvInteger",
                      "Convolution", "GroupConvolution", "ConvTranspose"})  # fmt: skip


def flops(op: str, inputs: Sequence[Sequence[int]], output: Sequence[int] | None) -> float | None:
    """FLOPs of one kernel from its input and output shapes, for matmuls and convolutions
    (None for other ops, or when a shape needed is missing)."""
    if output is None or not inputs:
        return None
    if op in CONV_OPS:
        weights = [s for s in inputs[1:] if len(s) == len(output)]
        if op == "QLinearConv" and len(inputs) > 3:
            weights = [inputs[3]]
        return conv_flops(output, weights[0]) if weights else None
    if op in MATMUL_OPS:
        a = inputs[0]
        return matmul_flops(output, int(a[-1])) if a else None
    return None
