"""Sum-preserving weight rounding for a Q/DQ model: round each output channel's weights so
that their integer sum is the nearest integer to the float sum, a data-free step towards
AdaRound (Nagel et al. 2020) for the failure mode that dominates MobileNetV2.

Why: after BatchNorm folding many of MobileNetV2's depthwise kernels are edge detectors
whose weights are large (up to 15) but sum to almost zero (e.g. -0.06), and their input is a
smooth, positive ReLU6 output. Rounding each weight to the nearest level moves the kernel's sum
by up to ``9 * scale / 2``, so a flat region that gave ~0 now leaks its local brightness
into the output. Bias correction (:mod:`enginekit.calibration.bias`) takes off the *mean*
of that leak, not its spatially varying part. Choosing the rounding direction of the weights
closest to a half step so that the channel's sum is kept (each weight still within one step
of its float value, no new extremes) removes the leak's DC part. Measured on MobileNetV2
(ImageNet weights, 8-bit per-channel weights only, activations float, 200 photo crops): output
NMSE 0.018 -> 0.0024, top-1 agreement with fp32 83% -> 96%; with 7-bit weights 0.10 -> 0.039.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.calibration.bias import int_attr, qdq_copy


def preserve_sums(
    qdq: onnx.ModelProto, source: onnx.ModelProto
) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``qdq`` whose Conv/Gemm int8/uint8 weights are re-rounded so that each output
    channel's sum matches the float weights' (see module doc), and the layers changed.

    Layers are matched to ``source`` by node name; a layer whose weight is not a
    DequantizeLinear of initializers, or whose float weight is not an initializer of
    ``source``, is left as it is.
    """
    out, graph, src_nodes, src_init, producer, init = qdq_copy(qdq, source)
    done = []
    for node, src, dq in quantized_weights(graph, src_nodes, src_init, producer, init):
        weight = numpy_helper.to_array(src_init[src.input[1]]).astype(np.float64)
        q = numpy_helper.to_array(init[dq.input[0]])
        if q.dtype not in (np.int8, np.uint8) or q.shape != weight.shape:
            continue
        scale = numpy_helper.to_array(init[dq.input[1]]).astype(np.float64)
        zero = numpy_helper.to_array(init[dq.input[2]]).astype(np.int64)
        if int_attr(dq, "axis", 1) != 0 and scale.ndim:
            continue
        rows = weight.shape[0]
        scale = np.broadcast_to(scale.reshape(-1, 1), (rows, 1))
        zero = np.broadcast_to(zero.reshape(-1, 1), (rows, 1))
        fixed = _round_keeping_sums(
            weight.reshape(rows, -1) / scale, q.reshape(rows, -1).astype(np.int64) - zero
        )
        if fixed is None:
            continue
        values = (fixed + zero).reshape(q.shape).astype(q.dtype)
        init[dq.input[0]].CopyFrom(numpy_helper.from_array(values, dq.input[0]))
        done.append(node.name)
    return out, done


def quantized_weights(
    graph: onnx.GraphProto,
    src_nodes: dict[str, onnx.NodeProto],
    src_init: dict[str, onnx.TensorProto],
    producer: dict[str, onnx.NodeProto],
    init: dict[str, onnx.TensorProto],
) -> list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """The Conv/Gemm layers of a Q/DQ graph whose weight a re-rounding may rewrite, as (node,
    its float source node, the weight's DequantizeLinear): the weight is a DequantizeLinear of
    initializers read by nothing else, the float weight an initializer of the source, and a
    Gemm's output channels are axis 0 of its weight (transB)."""
    readers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    found = []
    for node in graph.node:
        src = src_nodes.get(node.name)
        if node.op_type not in ("Conv", "Gemm") or src is None or len(node.input) < 2:
            continue
        dq = producer.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or src.input[1] not in src_init:
            continue
        if not all(i in init for i in dq.input[:3]) or readers.get(dq.input[0], 0) != 1:
            continue
        if node.op_type == "Gemm" and not int_attr(src, "transB", 0):
            continue  # weights [K, N]: the output channels are not axis 0
        found.append((node, src, dq))
    return found


def _round_keeping_sums(x: np.ndarray, q: np.ndarray) -> np.ndarray | None:
    """``q`` (integers, one row per output channel, the rounding of ``x``) moved by one step
    on the entries closest to a half step until each row's sum is ``round(x.sum())``, no
    entry beyond the row's largest |q|; None when nothing changes."""
    out = q.copy()
    bound = np.abs(q).max(axis=1)
    need = np.round(x.sum(axis=1)) - q.sum(axis=1)
    changed = False
    for c in np.nonzero(need)[0]:
        step = int(np.sign(need[c]))
        # Entries whose float value lies furthest towards ``step`` from their rounding first.
        order = np.argsort(-(x[c] - q[c]) * step, kind="stable")
        left = int(abs(need[c]))
        for i in order:
            if left == 0:
                break
            if abs(out[c, i] + step) <= bound[c] and abs(out[c, i] + step - x[c, i]) <= 1.0:
                out[c, i] += step
                left -= 1
                changed = True
    return out if changed else None
