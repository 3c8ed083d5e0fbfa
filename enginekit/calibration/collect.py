"""Run the float model on calibration batches and feed every activation to an observer.

The model is copied with every floating-point activation made a graph output (ONNX Runtime
then keeps each one), and run on CPU one batch at a time: memory holds one batch's
activations, never the dataset.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.calibration.observers import RangeObserver
from enginekit.calibration.table import WeightRange
from enginekit.errors import CalibrationError
from enginekit.model import Model
from enginekit.quiet import ort_severity, quiet_onnxruntime

log = logging.getLogger(__name__)

_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
_LARGE_BYTES = 1 << 30


def activation_names(proto: onnx.ModelProto) -> list[str]:
    """Floating-point tensors of the main graph whose values depend on the inputs, in order:
    float inputs first, then node outputs (constants and constant-only subgraphs excluded)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:  # onnx raises several types; the float types are a convenience
        log.info("shape inference failed (%s); keeping activations of unknown type", exc)
        inferred = proto
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in list(inferred.graph.value_info)
        + list(inferred.graph.input)
        + list(inferred.graph.output)
    }
    constant = {t.name for t in proto.graph.initializer}
    names: list[str] = []
    for v in proto.graph.input:
        if v.name not in constant and types.get(v.name) in _FLOAT_TYPES:
            names.append(v.name)
    for node in proto.graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type == "Constant" or (inputs and all(i in constant for i in inputs)):
            constant.update(o for o in node.output if o)
            continue
        for out in node.output:
            # Unknown type (shape inference gave up): keep it; non-float arrays are skipped later.
            if out and types.get(out, onnx.TensorProto.FLOAT) in _FLOAT_TYPES:
                names.append(out)
    return names


def augmented(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of the model with every tensor in ``names`` also a graph output."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    # Inputs are observed from the feeds themselves.
    existing = {o.name for o in out.graph.output} | {i.name for i in out.graph.input}
    for name in names:
        if name not in existing:
            out.graph.output.append(onnx.ValueInfoProto(name=name))
    return out


def session(proto: onnx.ModelProto, threads: int = 0) -> Any:
    """An ONNX Runtime CPU session; basic optimizations only (exact: constant folding and fusions
    that keep every graph output), so every tensor is what the float graph computes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.intra_op_num_threads = threads
    quiet_onnxruntime()
    so.log_severity_level = ort_severity()
    try:
        if proto.ByteSize() < _LARGE_BYTES:
            return ort.InferenceSession(
                proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
            )
        # Protobuf cannot serialize 2 GiB: hand ORT a file with external data instead.
        with tempfile.TemporaryDirectory(prefix="enginekit-calib-") as tmp:
            path = Path(tmp) / "model.onnx"
            onnx.save_model(proto, str(path), save_as_external_data=True, location="model.data")
            return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise CalibrationError(
            f"ONNX Runtime cannot run the model to calibrate it: {exc}"
        ) from None


def observe(
    model: Model,
    stream: Iterable[dict[str, np.ndarray]],
    histogram: bool,
    bins: int,
    on_batch: Any = None,
) -> tuple[dict[str, RangeObserver], int, int]:
    """Run every batch of ``stream`` and collect each activation's range (and histogram).

    Returns:
        (observers by tensor name, samples seen, batches seen).

    Raises:
        CalibrationError: the model cannot run on a batch, or the stream is empty.
    """
    names = activation_names(model.proto)
    sess = session(augmented(model.proto, names))
    outputs = [o.name for o in sess.get_outputs() if o.name in set(names)]
    observers = {n: RangeObserver(n, bins, histogram) for n in names}
    samples = count = 0
    for feeds in stream:
        for name, array in feeds.items():
            if name in observers:
                observers[name].update(array)
        try:
            values = sess.run(outputs, feeds)
        except Exception as exc:
            shapes = ", ".join(f"{n}: {a.shape}" for n, a in feeds.items())
            raise CalibrationError(
                f"the model fails on calibration batch {count} ({shapes}): {exc}"
            ) from None
        for name, value in zip(outputs, values):
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                observers[name].update(value)
        del values
        first = next(iter(feeds.values()))
        samples += int(first.shape[0]) if first.ndim else 1
        count += 1
        if on_batch is not None:
            on_batch(count, samples)
    if count == 0:
        raise CalibrationError(
            "the calibration data is empty (no batch with at least one sample); give it "
            "representative inputs, a few hundred samples is typical"
        )
    return {n: o for n, o in observers.items() if o.count}, samples, count


def weight_axes(proto: onnx.ModelProto) -> dict[str, int]:
    """Initializer weights of Conv/ConvTranspose/Gemm/MatMul and their output-channel axis."""
    init = {t.name: t for t in proto.graph.initializer}
    axes: dict[str, int] = {}
    for node in proto.graph.node:
        if len(node.input) < 2 or node.input[1] not in init:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv":
            axes[node.input[1]] = 0
        elif node.op_type == "ConvTranspose":
            axes[node.input[1]] = 1
        elif node.op_type == "Gemm":
            axes[node.input[1]] = 0 if attrs.get("transB", 0) else 1
        elif node.op_type == "MatMul" and len(init[node.input[1]].dims) >= 2:
            axes[node.input[1]] = len(init[node.input[1]].dims) - 1
    return axes


def weight_ranges(proto: onnx.ModelProto) -> dict[str, WeightRange]:
    """Per-output-channel symmetric ranges (max |w| per channel) of the quantizable weights."""
    init = {t.name: t for t in proto.graph.initializer}
    out = {}
    for name, axis in weight_axes(proto).items():
        w = numpy_helper.to_array(init[name])
        if w.dtype.kind != "f" or w.ndim == 0:
            continue
        moved = np.moveaxis(np.abs(w.astype(np.float32)), axis, 0).reshape(w.shape[axis], -1)
        out[name] = WeightRange(axis, tuple(float(v) for v in moved.max(axis=1)))
    return out


def has_qdq(proto: onnx.ModelProto) -> bool:
    """Whether the model already carries QuantizeLinear/DequantizeLinear (e.g. from QAT)."""
    return any(n.op_type in _QDQ_OPS for n in proto.graph.node)
