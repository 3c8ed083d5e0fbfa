"""Cross-layer equalization (CLE, Nagel et al. 2019, "Data-Free Quantization"): rescale the
output channels of one convolution and the matching input channels of the next so that both
have the same per-channel weight range, without changing the float model's outputs.

For ``y = conv2(act(conv1(x)))`` with a positive-homogeneous ``act`` (none, Relu: ``act(x/s)
= act(x)/s`` for ``s > 0``), dividing conv1's output channel ``c`` (weights and bias) by
``s_c`` and multiplying conv2's input channel ``c`` by ``s_c`` leaves ``y`` unchanged.
``s_c = sqrt(r1_c / r2_c)`` (``r1_c``: conv1's largest |weight| in output channel ``c``,
``r2_c``: conv2's largest |weight| reading channel ``c``) makes both ranges
``sqrt(r1_c * r2_c)``. Chains (MobileNet's expand -> depthwise -> project) are swept until
the scales settle.

Why it matters for int8: MobileNetV2's depthwise convolutions have per-channel weight ranges
spanning orders of magnitude, so their *outputs* do too, and a per-tensor activation scale
rounds the small channels to a few levels. Equalizing moves that spread into the next
convolution's weights, where per-channel scales absorb it.

``Clip(0, hi)`` (ReLU6) is not homogeneous: the clip point moves with the scale. With
``clip="scaled"`` (the default) the pair is equalized all the same and the Clip becomes
``Min(Relu(x), hi / s)`` with a per-channel bound (exact); ``clip="skip"`` leaves such pairs
alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.errors import BuildError

#: How pairs through ``Clip(0, hi)`` are handled: ``scaled`` (per-channel bound) or ``skip``.
CLIP_MODES = ("scaled", "skip")
SWEEPS = 20
#: Scales kept within [1/MAX_SCALE, MAX_SCALE]: a dead channel (all-zero weights) on one
#: side must not blow the other up.
MAX_SCALE = 1e4


@dataclasses.dataclass(frozen=True)
class Equalized:
    """What :func:`equalize` did: the pairs equalized (conv names), Clips made per-channel,
    and the largest ratio of per-channel weight ranges before and after (over the pairs)."""

    pairs: tuple[tuple[str, str], ...]
    clips_rewritten: tuple[str, ...]
    spread_before: float
    spread_after: float

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": "cross_layer_equalization",
            "pairs": len(self.pairs),
            "clips_rewritten": len(self.clips_rewritten),
            "weight_range_spread_before": self.spread_before,
            "weight_range_spread_after": self.spread_after,
        }


@dataclasses.dataclass
class _Pair:
    conv1: onnx.NodeProto
    act: onnx.NodeProto | None
    conv2: onnx.NodeProto
    clip_hi: float | None = None  # Clip(0, hi) between the two


def equalize(
    proto: onnx.ModelProto, clip: str = "scaled", sweeps: int = SWEEPS
) -> tuple[onnx.ModelProto, Equalized]:
    """A copy of ``proto`` with every equalizable Conv pair equalized (see module doc).

    A pair is ``Conv -> [Relu | Clip(0, hi)] -> Conv`` where each tensor in between has one
    reader, both weights (and biases) are initializers read by that Conv alone, and the second
    Conv reads the channels the first writes.

    Raises:
        BuildError: ``clip`` is not one of :data:`CLIP_MODES`.
    """
    if clip not in CLIP_MODES:
        raise BuildError(f"equalize clip={clip!r}: expected one of {', '.join(CLIP_MODES)}")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    arrays = {name: numpy_helper.to_array(t).copy() for name, t in inits.items()}
    pairs = _pairs(graph, arrays, clip)
    if not pairs:
        return out, Equalized((), (), 1.0, 1.0)
    before = _spread(pairs, arrays)
    total: dict[str, np.ndarray] = {}  # conv1 output -> accumulated scale (for Clip bounds)
    for _ in range(sweeps):
        moved = 0.0
        for p in pairs:
            w1, w2 = arrays[p.conv1.input[1]], arrays[p.conv2.input[1]]
            r1 = _out_ranges(w1)
            r2 = _in_ranges(w2, _group(p.conv2), len(r1))
            with np.errstate(divide="ignore", invalid="ignore"):
                s = np.sqrt(r1 / r2)
            s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
            s = np.clip(s, 1 / MAX_SCALE, MAX_SCALE).astype(np.float64)
            _scale_out(arrays, p.conv1, 1 / s)
            _scale_in(arrays, p.conv2, s, len(r1))
            key = p.conv1.output[0]
            total[key] = total.get(key, np.ones_like(s)) * s
            moved = max(moved, float(np.abs(np.log(s)).max()))
        if moved < 1e-3:
            break
    touched = {i for p in pairs for n in (p.conv1, p.conv2) for i in n.input[1:] if i}
    for name in touched:
        t = inits[name]
        t.CopyFrom(numpy_helper.from_array(arrays[name].astype(_dtype(t)), name))
    bounds = {}
    for p in pairs:
        s = total[p.conv1.output[0]]
        if p.clip_hi is not None and p.act is not None and not np.allclose(s, 1.0):
            bounds[p.act.output[0]] = (p.conv1, p.clip_hi / s)
    rewritten = tuple(bounds)
    if bounds:
        _scaled_clips(graph, bounds)
    names = tuple(
        (p.conv1.name or p.conv1.output[0], p.conv2.name or p.conv2.output[0]) for p in pairs
    )
    return out, Equalized(names, rewritten, before, _spread(pairs, arrays))


# -- finding pairs -----------------------------------------------------------------------------


def _pairs(graph: onnx.GraphProto, arrays: Mapping[str, np.ndarray], clip: str) -> list[_Pair]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    constants = _constants(graph, arrays)

    def only_reader(tensor: str) -> onnx.NodeProto | None:
        found = readers.get(tensor, [])
        return found[0] if len(found) == 1 and tensor not in outputs else None

    def own_weights(conv: onnx.NodeProto) -> bool:
        names = [i for i in conv.input[1:] if i]
        return all(n in arrays and len(readers.get(n, [])) == 1 for n in names) and (
            arrays[conv.input[1]].ndim >= 3
        )

    pairs = []
    for conv1 in graph.node:
        if conv1.op_type != "Conv" or len(conv1.input) < 2 or not own_weights(conv1):
            continue
        nxt = only_reader(conv1.output[0])
        act, hi = None, None
        if nxt is not None and nxt.op_type in ("Relu", "Clip"):
            act = nxt
            if nxt.op_type == "Clip":
                bounds = _clip_bounds(nxt, constants)
                if bounds is None or bounds[0] != 0.0 or clip == "skip":
                    continue
                hi = bounds[1]
            nxt = only_reader(nxt.output[0])
        if nxt is None or nxt.op_type != "Conv" or not own_weights(nxt):
            continue
        channels = arrays[conv1.input[1]].shape[0]
        w2 = arrays[nxt.input[1]]
        if w2.shape[1] * _group(nxt) != channels:
            continue
        pairs.append(_Pair(conv1, act, nxt, hi))
    return pairs


def _constants(graph: onnx.GraphProto, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(arrays)
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def _clip_bounds(
    node: onnx.NodeProto, constants: Mapping[str, np.ndarray]
) -> tuple[float, float] | None:
    """(min, max) of a Clip with constant scalar bounds (attributes before opset 11)."""
    lo, hi = -np.inf, np.inf
    for a in node.attribute:
        if a.name == "min":
            lo = a.f
        elif a.name == "max":
            hi = a.f
    for k, name in ((1, "lo"), (2, "hi")):
        if len(node.input) > k and node.input[k]:
            value = constants.get(node.input[k])
            if value is None or value.size != 1:
                return None
            if name == "lo":
                lo = float(value.reshape(()))
            else:
                hi = float(value.reshape(()))
    return (float(lo), float(hi)) if np.isfinite(hi) else None


def _group(conv: onnx.NodeProto) -> int:
    return next((int(a.i) for a in conv.attribute if a.name == "group"), 1)


# -- ranges and scaling ------------------------------------------------------------------------


def _out_ranges(w: np.ndarray) -> np.ndarray:
    return np.abs(w).reshape(w.shape[0], -1).max(axis=1).astype(np.float64)


def _in_ranges(w: np.ndarray, group: int, channels: int) -> np.ndarray:
    """Largest |weight| reading each input channel of a (grouped) conv weight [O, C/g, ...]."""
    per = channels // group
    out_per = w.shape[0] // group
    a = np.abs(w).reshape(group, out_per, per, -1).max(axis=(1, 3))  # [group, per]
    return a.reshape(channels).astype(np.float64)


def _scale_out(arrays: dict[str, np.ndarray], conv: onnx.NodeProto, f: np.ndarray) -> None:
    w = arrays[conv.input[1]]
    arrays[conv.input[1]] = w * f.reshape(-1, *([1] * (w.ndim - 1)))
    if len(conv.input) > 2 and conv.input[2]:
        arrays[conv.input[2]] = arrays[conv.input[2]] * f


def _scale_in(
    arrays: dict[str, np.ndarray], conv: onnx.NodeProto, s: np.ndarray, channels: int
) -> None:
    w = arrays[conv.input[1]]
    group = _group(conv)
    per, out_per = channels // group, w.shape[0] // group
    shaped = w.reshape(group, out_per, per, -1) * s.reshape(group, 1, per, 1)
    arrays[conv.input[1]] = shaped.reshape(w.shape)


def _spread(pairs: list[_Pair], arrays: Mapping[str, np.ndarray]) -> float:
    """Largest max/min ratio of per-channel weight ranges over the pairs' convolutions
    (output channels of the first, input channels of the second; dead channels ignored)."""
    worst = 1.0
    for p in pairs:
        r1 = _out_ranges(arrays[p.conv1.input[1]])
        r2 = _in_ranges(arrays[p.conv2.input[1]], _group(p.conv2), len(r1))
        for r in (r1, r2):
            live = r[r > 0]
            if live.size:
                worst = max(worst, float(live.max() / live.min()))
    return worst


def _dtype(t: onnx.TensorProto) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(t.data_type)


def _scaled_clips(
    graph: onnx.GraphProto, bounds: Mapping[str, tuple[onnx.NodeProto, np.ndarray]]
) -> None:
    """Each Clip(x, 0, hi) named by its output in ``bounds`` -> Min(Relu(x), hi_c): the
    per-channel bound its scaled channels need (``hi_c`` shaped [C, 1, ...] to broadcast)."""
    nodes = []
    for n in graph.node:
        if n.op_type != "Clip" or n.output[0] not in bounds:
            nodes.append(n)
            continue
        conv1, hi = bounds[n.output[0]]
        dims = len(_weight_shape(graph, conv1)) - 2
        out = n.output[0]
        bound = f"{out}_cle_bound"
        graph.initializer.append(
            numpy_helper.from_array(hi.astype(np.float32).reshape(-1, *([1] * dims)), bound)
        )
        nodes.append(
            onnx.helper.make_node(
                "Relu", [n.input[0]], [f"{out}_cle_relu"], name=f"{n.name}_cle_relu"
            )
        )
        nodes.append(
            onnx.helper.make_node(
                "Min", [f"{out}_cle_relu", bound], [out], name=f"{n.name}_cle_min"
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)


def _weight_shape(graph: onnx.GraphProto, conv: onnx.NodeProto) -> tuple[int, ...]:
    t = next(t for t in graph.initializer if t.name == conv.input[1])
    return tuple(t.dims)
