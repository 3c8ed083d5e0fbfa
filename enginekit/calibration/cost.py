"""What keeping a layer in float costs: its multiply-accumulates per input row, the speed
proxy the accuracy search ranks plans by.

Why not the number of float layers: the int8 speed-up is where the arithmetic is, and that is
not spread evenly. On MobileNetV2 with OpenVINO (AVX2, batch 8, measured under load) the 16
*last* quantized layers kept in float ran as fast as all-int8 (1.79x vs 1.75x fp32), the 16
*first* ones cost as much as 16 scattered ones (1.45x, 1.47x): the early layers run at
112x112 and 56x56, the late ones at 7x7. Reorders at float/int8 boundaries measured ~5% of
the time with 13 islands, so where the float layers are matters far more than how many
boundaries they make. MACs are the proxy because they need no run: a plan's cost is the sum
over its float layers, deterministic where timings on a loaded machine are noise.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx


def layer_macs(source: onnx.ModelProto, names: Iterable[str]) -> dict[str, float]:
    """Multiply-accumulates per input row of each node ``names`` of ``source``: for a Conv,
    ConvTranspose, Gemm or MatMul with a weight initializer, output elements per row
    (symbolic dims such as the batch count as 1) times the weight elements one output element
    reads (its weight's size where the output shape cannot be inferred); for any other node
    (a residual Add) its output elements per row; 0 where neither is known."""
    wanted = set(names)
    try:
        inferred = onnx.shape_inference.infer_shapes(source)
    except Exception:  # a model shape inference cannot handle: weight sizes only
        inferred = source
    graph = inferred.graph
    shapes = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else 1 for d in v.type.tensor_type.shape.dim
        ]
        for v in (*graph.value_info, *graph.output)
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }
    weights = {t.name: t for t in graph.initializer}
    out: dict[str, float] = {}
    for node in graph.node:
        if node.name not in wanted:
            continue
        shape = shapes.get(node.output[0]) if node.output else None
        # Batch (and any other symbolic dim) counted as 1: a cost per input row.
        elements = None
        if shape:
            elements = float(np.prod(shape[1:])) if len(shape) > 1 else float(shape[0])
        w = weights.get(node.input[1]) if len(node.input) > 1 else None
        dims = list(w.dims) if w is not None else []
        if not dims or node.op_type not in _WEIGHTED:
            # An elementwise op (a residual Add): about one operation per output element.
            out[node.name] = elements or 0.0
            continue
        size = float(np.prod(dims))
        out[node.name] = size if elements is None else elements * size / _outputs_of(node, dims)
    for name in wanted - out.keys():
        out[name] = 0.0
    return out


_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _outputs_of(node: onnx.NodeProto, dims: list[int]) -> int:
    """How many output channels the weight ``dims`` of ``node`` has (the weight elements one
    output element reads are its size over this)."""
    if node.op_type == "Conv":
        return max(dims[0], 1)
    if node.op_type == "ConvTranspose":
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        return max(dims[1] * group, 1)
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return max(dims[0] if trans_b else dims[-1], 1)
    return max(dims[-1], 1)  # MatMul: [..., K, N]


def plan_cost(costs: dict[str, float], kept: Iterable[str]) -> float:
    """The share (0..1) of the quantized layers' MACs that a plan keeping ``kept`` in float
    runs in float."""
    total = sum(costs.values())
    return sum(costs.get(n, 0.0) for n in kept) / total if total else 0.0


__all__ = ["layer_macs", "plan_cost"]
