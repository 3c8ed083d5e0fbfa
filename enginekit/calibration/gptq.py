"""Error-compensating weight rounding (GPTQ, Frantar et al. 2022) for a Q/DQ model: each
layer's int8 weights re-rounded one input column at a time, the rounding error of each column
pushed onto the columns not yet rounded, weighted by the layer's input second moments
``H = E[x xᵀ]`` measured on calibration rows. Scales, zero points and biases stay as they are.

Why: on MobileNetV2 the output error of an int8 build is dominated by the *weights* of its
first few layers (the first depthwise and pointwise convolutions: their few weights per
output channel are rounded independently, and the errors of one channel's weights add up
on the smooth ReLU6 inputs they read). Rounding to the nearest level minimises each weight's
error; GPTQ minimises the layer's *output* error ``(W_q - W) H (W_q - W)ᵀ`` instead.
Sum-preserving rounding (:mod:`enginekit.calibration.rounding`) is the data-free special case
for a flat input (``H`` all ones). Depthwise convolutions get one ``H`` per channel (9x9 for a
3x3 kernel); other convolutions one over their ``C·kh·kw`` patches; Gemm one over its inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.calibration.bias import int_attr, qdq_copy
from enginekit.calibration.rounding import quantized_weights

#: Rows of calibration data the second moments are taken on (each row is one image's worth of
#: patches: thousands of samples per layer, enough for a 960-dim ``H`` with damping).
ROWS = 16
#: Dampening added to ``H``'s diagonal, as a fraction of its mean (GPTQ's default).
DAMP = 0.01


def gptq_round(
    qdq: onnx.ModelProto,
    source: onnx.ModelProto,
    rows: Sequence[Mapping[str, np.ndarray]],
    moments: dict[str, np.ndarray] | None = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``qdq`` whose Conv/Gemm per-channel int8/uint8 weights are re-rounded by
    GPTQ against their float inputs on ``rows`` (see module doc), and the layers changed.

    Layers are matched to ``source`` by node name; a layer whose weight is not a
    DequantizeLinear of initializers (per output channel or per tensor), or whose float weight
    is not an initializer of ``source``, is left as it is. Each weight stays within the range
    its layer's rounding used (7-bit weights stay 7-bit). ``moments``: a dict shared by
    calls on Q/DQ models of the same ``source`` and ``rows`` (the second moments depend on
    the float model only), filled on first use.
    """
    out, graph, src_nodes, src_init, producer, init = qdq_copy(qdq, source)
    layers = []
    for node, src, dq in quantized_weights(graph, src_nodes, src_init, producer, init):
        if node.op_type == "Conv" and _kind(src, src_init) is None:
            continue
        if int_attr(dq, "axis", 1) != 0 and numpy_helper.to_array(init[dq.input[1]]).ndim:
            continue
        layers.append((node, src, dq))
    if not layers or not rows:
        return out, []
    moments = {} if moments is None else moments
    missing = [
        (src, _kind(src, src_init), tuple(int(d) for d in src_init[src.input[1]].dims[2:]))
        for _, src, _ in layers
        if src.name not in moments
    ]
    if missing:
        moments.update(_moments(source, missing, rows))
    done = []
    for node, src, dq in layers:
        h = moments.get(src.name)
        weight = numpy_helper.to_array(src_init[src.input[1]]).astype(np.float64)
        q = numpy_helper.to_array(init[dq.input[0]])
        if h is None or q.dtype not in (np.int8, np.uint8) or q.shape != weight.shape:
            continue
        rows_ = weight.shape[0]
        scale = np.broadcast_to(
            numpy_helper.to_array(init[dq.input[1]]).astype(np.float64).reshape(-1, 1), (rows_, 1)
        )
        zero = np.broadcast_to(
            numpy_helper.to_array(init[dq.input[2]]).astype(np.int64).reshape(-1, 1), (rows_, 1)
        )
        ints = q.reshape(rows_, -1).astype(np.int64) - zero
        bound = int(np.abs(ints).max())
        x = weight.reshape(rows_, -1) / scale
        fixed = _gptq(x, h, bound)
        if np.array_equal(fixed, ints):
            continue
        values = (fixed + zero).reshape(q.shape)
        info = np.iinfo(q.dtype)
        values = np.clip(values, info.min, info.max).astype(q.dtype)
        init[dq.input[0]].CopyFrom(numpy_helper.from_array(values, dq.input[0]))
        done.append(node.name)
    return out, done


def _kind(src: onnx.NodeProto, src_init: Mapping[str, onnx.TensorProto]) -> str | None:
    """``dense`` or ``depthwise`` for a 2-D Conv whose patches this module can form (no
    dilation, explicit pads), else None."""
    if src.op_type == "Gemm":
        return "gemm"
    shape = list(src_init[src.input[1]].dims)
    if len(shape) != 4 or any(int(d) != 1 for d in _ints(src, "dilations", [1, 1])):
        return None
    if next((a.s for a in src.attribute if a.name == "auto_pad"), b"NOTSET") not in (
        b"NOTSET",
        b"VALID",
    ):
        return None
    groups = int_attr(src, "group", 1)
    if groups == 1:
        return "dense"
    return "depthwise" if shape[1] == 1 and shape[0] == groups else None


def _ints(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == name), default)


def _moments(
    source: onnx.ModelProto,
    layers: Sequence[tuple[onnx.NodeProto, str | None, tuple[int, ...]]],
    rows: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """``Σ x xᵀ`` over each layer's input patches (per channel for depthwise: ``[C, k, k]``)
    on the float model, on up to :data:`ROWS` rows."""
    from enginekit.calibration.accuracy import ort_runner

    model = copy.deepcopy(source)
    have = {o.name for o in model.graph.output}
    for src, _, _ in layers:
        if src.input[0] not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=src.input[0]))
            have.add(src.input[0])
    order = [o.name for o in model.graph.output]
    run = ort_runner(model)
    sums: dict[str, np.ndarray] = {}
    seen = 0
    for feeds in rows:
        if seen >= ROWS:
            break
        seen += int(next(iter(feeds.values())).shape[0])
        values = dict(zip(order, run(feeds)))
        for src, kind, kernel in layers:
            x = np.asarray(values[src.input[0]], np.float32)
            if kind == "gemm":
                h = x.reshape(-1, x.shape[-1]).T @ x.reshape(-1, x.shape[-1])
            else:
                patches = _patches(x, src, kernel, kind == "depthwise")
                if kind == "depthwise":
                    h = np.matmul(patches.transpose(0, 2, 1), patches)
                else:
                    h = patches.T @ patches
            sums[src.name] = sums.get(src.name, 0) + h.astype(np.float64)
    return sums


def _patches(
    x: np.ndarray, src: onnx.NodeProto, kernel: Sequence[int], depthwise: bool
) -> np.ndarray:
    """A Conv's input patches: ``[P, C·kh·kw]`` (dense) or ``[C, P, kh·kw]`` (depthwise), in
    the order of the weight's flattened axes; ``kernel``: the weight's spatial dims (the
    ``kernel_shape`` attribute is optional)."""
    kh, kw = kernel
    sh, sw = _ints(src, "strides", [1, 1])
    top, left, bottom, right = (_ints(src, "pads", [0, 0, 0, 0]) + [0, 0, 0, 0])[:4]
    if kh == kw == 1 and sh == sw == 1 and not any((top, left, bottom, right)):
        flat = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])
        return flat.T[:, :, None] if depthwise else flat
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    n, c, ho, wo = win.shape[:4]
    if depthwise:  # [C, N·Ho·Wo, kh·kw]
        return np.ascontiguousarray(np.moveaxis(win, 1, 0)).reshape(c, n * ho * wo, kh * kw)
    return np.ascontiguousarray(win.transpose(0, 2, 3, 1, 4, 5)).reshape(n * ho * wo, -1)


def _gptq(x: np.ndarray, h: np.ndarray, bound: int) -> np.ndarray:
    """Integers for ``x`` (one row per output channel, in units of the row's scale), rounded
    column by column with each column's error compensated on the later ones through ``h``
    (``[d, d]`` shared, or ``[rows, d, d]`` one per row), within ``[-bound, bound]``."""
    w = x.copy()
    d = w.shape[1]
    h = np.array(h if h.ndim == 3 else h[None], np.float64)  # [1 or rows, d, d]
    diag = np.einsum("kii->ki", h)
    dead = diag <= 0
    diag[dead] = 1.0
    w[np.broadcast_to(dead, w.shape)] = 0  # inputs that are always 0: their weights are moot
    damp = DAMP * diag.mean(axis=1, keepdims=True)
    idx = np.arange(d)
    h[:, idx, idx] = diag + damp
    try:
        inv = np.linalg.inv(h)
        upper = np.transpose(np.linalg.cholesky(inv), (0, 2, 1))  # inv = Uᵀ U
    except np.linalg.LinAlgError:
        return np.clip(np.round(x), -bound, bound).astype(np.int64)
    out = np.empty_like(w, dtype=np.int64)
    for i in range(d):
        col = w[:, i]
        q = np.clip(np.round(col), -bound, bound)
        out[:, i] = q
        err = (col - q) / upper[:, i, i]  # [rows] (or [1], shared by every row)
        w[:, i + 1 :] -= err[:, None] * upper[:, i, i + 1 :]
    return out
