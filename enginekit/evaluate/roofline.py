"""``roofline``: what bounds a model's latency on this host — arithmetic or memory traffic.

From an ONNX model with concrete input shapes, :func:`costs` counts each node's FLOPs (Conv,
ConvTranspose, Gemm, MatMul: 2 x multiply-adds; bias adds and elementwise ops are not counted),
its weight bytes (inputs that are initializers or Constant outputs) and its activation bytes
(its other inputs and its outputs, shapes from ONNX shape inference). :func:`read_bandwidth`
measures how fast this host streams memory; :func:`floors` turns the counts and the two rates
(FLOP/s from :func:`enginekit.evaluate.profile.matmul_peak`, bytes/s) into latency floors:

- ``compute_ms``: all FLOPs at the matmul peak;
- ``weights_ms``: every weight byte read once at the measured bandwidth;
- ``serial_ms`` (layer-serial): nodes one after another, each taking the longer of its FLOPs at
  the peak and its traffic at the bandwidth — traffic being its weight bytes (streamed from
  memory: assumed not to stay cached between calls) plus the part of its activation bytes that
  exceeds the last-level cache (activations that fit are taken as served by the cache);
- ``resident_ms``: ``serial_ms`` with the best case for the cache: up to ``cache_bytes`` of
  weights kept in the cache between calls, placed where they save the most time.

Each floor is a lower bound for the model as its nodes are counted: nodes whose shapes inference
could not resolve count 0 (listed in :attr:`ModelCost.unknown`). An engine that fuses layers
across the graph, or keeps weights in a larger cache, is bounded by ``compute_ms`` and
``resident_ms``, not by ``serial_ms``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from enginekit.errors import UsageError
from enginekit.model import ModelSource, load_model
from enginekit.target import cache_bytes

#: Op types whose FLOPs are counted.
COUNTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """One node's work.

    Attributes:
        name, op: the node's name (or ``op_index`` when unnamed) and op type.
        flops: 2 x multiply-adds for counted ops; 0 for others and where a shape is unknown.
        weight_bytes: bytes of its initializer (and Constant) inputs.
        activation_bytes: bytes of its other inputs and of its outputs (0 where unknown).
    """

    name: str
    op: str
    flops: float
    weight_bytes: int
    activation_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """A model's work at concrete input shapes, node by node.

    Attributes:
        shapes: the input shapes counted.
        nodes: every node of the main graph, in graph order.
        weight_bytes: bytes of all initializers and Constants the nodes read, each once.
        unknown: nodes of counted ops whose FLOPs are missing (a shape inference left unknown).
    """

    shapes: Mapping[str, tuple[int, ...]]
    nodes: tuple[NodeCost, ...]
    weight_bytes: int
    unknown: tuple[str, ...] = ()

    @property
    def flops(self) -> float:
        """Total FLOPs of the counted ops."""
        return sum(n.flops for n in self.nodes)

    @property
    def activation_bytes(self) -> int:
        """Sum of every node's activation bytes (a tensor read by k nodes counts k + 1 times)."""
        return sum(n.activation_bytes for n in self.nodes)


@dataclasses.dataclass(frozen=True)
class Floors:
    """Latency floors of one model on one host, in milliseconds (see the module docstring).

    Attributes:
        compute_ms, weights_ms, serial_ms, resident_ms: the floors.
        peak_gflops, bandwidth_gbs, cache_bytes: the rates and cache size they assume.
        bound_ms: of ``serial_ms``, the time of nodes whose traffic takes longer than their
            FLOPs (memory-bound nodes).
    """

    compute_ms: float
    weights_ms: float
    serial_ms: float
    resident_ms: float
    bound_ms: float
    peak_gflops: float
    bandwidth_gbs: float
    cache_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def floors(
    cost: ModelCost, peak_gflops: float, bandwidth_gbs: float, cache_bytes: int = 0
) -> Floors:
    """The latency floors of ``cost`` at a FLOP rate (GFLOP/s) and a memory bandwidth (GB/s),
    with a last-level cache of ``cache_bytes`` (0: no cache).

    Raises:
        UsageError: a rate is not positive, or the cache size is negative.
    """
    if peak_gflops <= 0 or bandwidth_gbs <= 0 or cache_bytes < 0:
        raise UsageError(
            f"peak_gflops={peak_gflops}, bandwidth_gbs={bandwidth_gbs}, cache_bytes="
            f"{cache_bytes}: need positive rates and a cache size >= 0"
        )
    peak, bandwidth = peak_gflops * 1e9, bandwidth_gbs * 1e9
    serial = bound = saveable = 0.0
    for n in cost.nodes:
        traffic = n.weight_bytes + max(0, n.activation_bytes - cache_bytes)
        compute_s, memory_s = n.flops / peak, traffic / bandwidth
        serial += max(compute_s, memory_s)
        if memory_s > compute_s:
            bound += memory_s
            # weight bytes whose caching would shorten this node, down to its compute time
            saveable += min(n.weight_bytes, traffic - compute_s * bandwidth)
    resident = serial - min(float(cache_bytes), saveable) / bandwidth
    return Floors(
        compute_ms=cost.flops / peak * 1e3,
        weights_ms=cost.weight_bytes / bandwidth * 1e3,
        serial_ms=serial * 1e3,
        resident_ms=resident * 1e3,
        bound_ms=bound * 1e3,
        peak_gflops=peak_gflops,
        bandwidth_gbs=bandwidth_gbs,
        cache_bytes=cache_bytes,
    )


# -- counting ------------------------------------------------------------------------------------


def costs(
    model: ModelSource,
    shapes: Mapping[str, Sequence[int]] | None = None,
    batch: int | None = None,
) -> ModelCost:
    """Each node's FLOPs, weight bytes and activation bytes at concrete input shapes.

    Args:
        model: an ONNX file, ModelProto or :class:`~enginekit.model.Model` (not modified: shape
            inference runs on a copy).
        shapes: input name -> full concrete shape; inputs not named here keep their declared
            shape.
        batch: the size of a symbolic first dim of the inputs not in ``shapes``.

    Raises:
        UsageError: an input keeps a symbolic dim (the message names the input and the dim),
            ``shapes`` names an unknown input or gives a shape of the wrong rank.
    """
    import onnx

    loaded = load_model(model)
    shapes = dict(shapes or {})
    names = [s.name for s in loaded.inputs]
    unknown_inputs = sorted(set(shapes) - set(names))
    if unknown_inputs:
        raise UsageError(
            f"shapes names {unknown_inputs}, not inputs of {loaded.label}; its inputs: {names}"
        )
    fixed = _fixed_shapes(loaded.inputs, shapes, batch)
    proto = onnx.ModelProto()
    proto.CopyFrom(loaded.proto)
    for value in proto.graph.input:
        if value.name in fixed:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, fixed[value.name], strict=True):
                dim.Clear()
                dim.dim_value = size
    # Shapes recorded at export (for another input size) would clash with the new ones and
    # stop inference at the first clash: infer every intermediate and output shape afresh.
    del proto.graph.value_info[:]
    for value in proto.graph.output:
        if value.type.HasField("tensor_type"):
            value.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    return _count(inferred.graph, fixed)


def _fixed_shapes(
    specs: Sequence[Any], shapes: Mapping[str, Sequence[int]], batch: int | None
) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        if spec.name in shapes:
            given = tuple(int(d) for d in shapes[spec.name])
            if len(given) != len(spec.shape):
                raise UsageError(
                    f"input {spec.name!r} has rank {len(spec.shape)} ({list(spec.shape)}); "
                    f"shapes gives {list(given)}"
                )
            out[spec.name] = given
            continue
        dims = []
        for axis, d in enumerate(spec.shape):
            if isinstance(d, int):
                dims.append(d)
            elif axis == 0 and batch is not None:
                dims.append(batch)
            else:
                raise UsageError(
                    f"input {spec.name!r} dim {axis} is symbolic ({d!r}); give its size with "
                    f"shapes={{{spec.name!r}: (...)}}" + (" or batch=N" if axis == 0 else "")
                )
        out[spec.name] = tuple(dims)
    return out


def _count(graph: Any, inputs: Mapping[str, tuple[int, ...]]) -> ModelCost:
    from onnx import helper, numpy_helper

    weights: dict[str, tuple[tuple[int, ...], int]] = {}  # name -> (shape, bytes)
    for t in graph.initializer:
        itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        weights[t.name] = (tuple(t.dims), math.prod(t.dims) * itemsize)
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            array = numpy_helper.to_array(node.attribute[0].t)
            weights[node.output[0]] = (tuple(array.shape), array.nbytes)
    tensors: dict[str, tuple[tuple[int, ...], int] | None] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensors[value.name] = _shape_bytes(value)
    nodes: list[NodeCost] = []
    used: set[str] = set()
    unknown: list[str] = []
    for index, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if node.op_type == "Constant":
            nodes.append(NodeCost(name, node.op_type, 0.0, 0, 0))
            continue
        ins = [i for i in node.input if i]
        weight_bytes = sum(weights[i][1] for i in ins if i in weights)
        used.update(i for i in ins if i in weights)
        acts = [tensors.get(i) for i in (*ins, *node.output) if i and i not in weights]
        activation_bytes = sum(a[1] for a in acts if a is not None)

        def shape(i: str) -> tuple[int, ...] | None:
            if i in weights:
                return weights[i][0]
            found = tensors.get(i)
            return found[0] if found is not None else None

        flops = _flops(node, [shape(i) for i in node.input], shape(node.output[0]))
        if flops is None:
            unknown.append(name)
        nodes.append(NodeCost(name, node.op_type, flops or 0.0, weight_bytes, activation_bytes))
    return ModelCost(
        shapes=dict(inputs),
        nodes=tuple(nodes),
        weight_bytes=sum(weights[i][1] for i in used),
        unknown=tuple(unknown),
    )


def _shape_bytes(value: Any) -> tuple[tuple[int, ...], int] | None:
    """(shape, bytes) of a tensor value_info, None unless every dim is known."""
    from onnx import helper

    kind = value.type.WhichOneof("value")
    if kind != "tensor_type" or not value.type.tensor_type.HasField("shape"):
        return None
    tensor = value.type.tensor_type
    dims = []
    for d in tensor.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return tuple(dims), math.prod(dims) * itemsize


def _attr(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _flops(
    node: Any, ins: Sequence[tuple[int, ...] | None], out: tuple[int, ...] | None
) -> float | None:
    """2 x multiply-adds of a counted op (0.0 for other ops, None where a shape is missing)."""
    op = node.op_type
    if op not in COUNTED_OPS:
        return 0.0
    if len(ins) < 2 or ins[0] is None or ins[1] is None or out is None:
        return None
    a, w = ins[0], ins[1]
    if op == "Conv":
        # weight [Cout, Cin/groups, k...]: each output element is Cin/groups * k... MACs
        return 2.0 * math.prod(out) * math.prod(w[1:])
    if op == "ConvTranspose":
        # weight [Cin, Cout/groups, k...]: each input element feeds Cout/groups * k... outputs
        return 2.0 * math.prod(a) * math.prod(w[1:])
    if op == "Gemm":
        k = a[0] if _attr(node, "transA", 0) else a[-1]
        return 2.0 * math.prod(out) * k
    return 2.0 * math.prod(out) * a[-1]  # MatMul: K is A's last dim (A 1-D: its only dim)


# -- the host ------------------------------------------------------------------------------------


def read_bandwidth(
    threads: int | None = None, nbytes: int | None = None, repeats: int = 3
) -> float:
    """This host's memory read bandwidth in GB/s: a streaming read of an array several times
    the last-level cache, split into one contiguous slice per thread.

    Each thread reduces its slice with numpy (``max``, and ``dot`` of the slice with itself:
    both release the GIL); the result is the best rate over the kernels and ``repeats`` passes.
    ``dot`` goes to the BLAS, which may add threads of its own: the rate is what numpy can read
    with at least ``threads`` threads, a floor's bandwidth (taking the best keeps the floors
    low). It measures reads only (no writes), from one process, on an otherwise busy or idle
    host as it is: rerun it to see the spread.

    Args:
        threads: Python threads reading (default: the CPUs this process may run on).
        nbytes: the array's size (default: 4x the last-level cache, at least 256 MiB).
        repeats: passes per kernel; the best counts.
    """
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            threads = os.cpu_count() or 1
    if threads < 1 or repeats < 1:
        raise UsageError(f"threads={threads}, repeats={repeats}: need both >= 1")
    if nbytes is None:
        nbytes = max(4 * (cache_bytes() or 0), 256 << 20)
    # distinct values in every page: a hypervisor that merges identical pages (KSM) would
    # serve an array of one repeated value from a single page, from the cache
    data = np.arange(nbytes // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    kernels = (np.max, lambda part: np.dot(part, part))
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for kernel in kernels:
            list(pool.map(kernel, parts))  # fault the pages in and warm the threads
            for _ in range(repeats):
                start = time.perf_counter()
                list(pool.map(kernel, parts))
                best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9
