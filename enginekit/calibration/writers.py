"""Turn a CalibrationTable into what each backend consumes.

- :func:`write_qdq`: a Q/DQ ONNX model (QuantizeLinear/DequantizeLinear pairs), the form
  TensorRT 10/11 (explicit quantization), ONNX Runtime and TVM build INT8 engines from.
  ONNX Runtime's quantizer places the pairs and quantizes the weights; our table supplies every
  activation range (through its calibration-cache hook), so ORT's own calibrators never run.
- :func:`write_trt_cache` / :func:`read_trt_cache`: TensorRT's legacy calibration cache text
  (for TensorRT <= 10 implicit calibration). Written by hand: nothing in ORT writes it.
- :func:`write_ort_trt_table`: ONNX Runtime's TensorRT execution provider table, through
  ``onnxruntime.quantization.write_calibration_table``.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.calibration.collect import has_qdq
from enginekit.calibration.table import INT8_MAX, CalibrationTable
from enginekit.errors import CalibrationError
from enginekit.model import Model, ModelSource, load_model

log = logging.getLogger(__name__)

#: Q/DQ placement styles. ``tensorrt``: int8 activations with zero point 0, pairs only on the
#: inputs of Conv/Gemm/MatMul and of Add (residual joins), biases left in float, as TensorRT
#: fuses them. ``onnxruntime-cpu``: uint8 activations over each tensor's clipped [min, max]
#: (Relu then folds into the zero point), int32 biases, every op ORT has a QLinear kernel for:
#: the layout ORT's CPU kernels run fastest (see docs/calibration.md for the measurements).
STYLES = ("tensorrt", "onnxruntime-cpu")
WEIGHT_TYPES = ("int8", "uint8")
_LARGE_BYTES = 1 << 30
_TRT_OPS = ["Conv", "ConvTranspose", "Gemm", "MatMul", "Add"]


def write_qdq(
    model: ModelSource,
    table: CalibrationTable,
    path: str | os.PathLike | None = None,
    *,
    style: str = "tensorrt",
    per_channel: bool = True,
    reduce_range: bool = False,
    op_types: Sequence[str] | None = None,
    exclude_nodes: Sequence[str] = (),
    allow_table_mismatch: bool = False,
    symbolic_shapes: bool = False,
    weight_type: str = "int8",
) -> onnx.ModelProto:
    """A Q/DQ ONNX model quantized with the table's ranges; standard ``ai.onnx`` ops only.

    Weights are int8, symmetric, per output channel (per tensor with ``per_channel=False``).

    Args:
        model: the float model the table was made for.
        table: its calibration table.
        path: also write the model here.
        style: ``tensorrt`` (portable: int8, zero points 0, float biases) or
            ``onnxruntime-cpu`` (uint8 activations, the fast layout for ORT's CPU kernels).
        per_channel: per-channel weight scales (else one scale per weight tensor).
        reduce_range: 7-bit weights where an x86 CPU without VNNI would saturate its int16
            pair sums: every weighted layer except depthwise convolutions, whose kernels
            multiply in 16/32 bits and keep all 8 bits (:func:`full_range_depthwise`).
        op_types: op types to quantize (default: the style's).
        exclude_nodes: node names to leave in float.
        allow_table_mismatch: accept a table made for another model hash.
        symbolic_shapes: run ORT's symbolic shape inference first (for models whose shapes
            ONNX shape inference cannot work out; it imports torch, ~10 s).
        weight_type: ``int8`` (symmetric) or ``uint8`` (``onnxruntime-cpu`` only; zero point
            128: ONNX Runtime's U8U8 kernels, which do not saturate on x86 CPUs without VNNI,
            where U8S8 does unless ``reduce_range`` costs the weights a bit).

    Raises:
        CalibrationError: a table for another model, a model already holding Q/DQ, or a
            tensor the quantizer needs that the table lacks.
    """
    if style not in STYLES:
        raise CalibrationError(f"Q/DQ style {style!r} is not one of {', '.join(STYLES)}")
    if weight_type not in WEIGHT_TYPES or (weight_type == "uint8" and style == "tensorrt"):
        raise CalibrationError(
            f"weight_type {weight_type!r} with style {style!r}: expected int8, or uint8 with "
            "the onnxruntime-cpu style"
        )
    m = load_model(model)
    table.check_model(m.sha256, allow_table_mismatch)
    if has_qdq(m.proto):
        raise CalibrationError(
            "the model already carries QuantizeLinear/DequantizeLinear nodes; it is quantized "
            "already (build it with precision='int8' as it is)"
        )
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data
    from onnxruntime.quantization.shape_inference import quant_pre_process

    trt = style == "tensorrt"
    ranges = {}
    for name, r in table.tensors.items():
        lo, hi = (-r.amax, r.amax) if trt else r.clipped_range()
        ranges[name] = TensorData(lowest=np.float32(lo), highest=np.float32(hi))
    ops = list(op_types) if op_types is not None else default_op_types(m.proto, style)
    extra: dict[str, Any] = {
        "ActivationSymmetric": trt,
        "WeightSymmetric": True,
        "QuantizeBias": not trt,
    }
    if trt:
        # TensorRT wants Q/DQ on inputs only; it fuses a weighted op's output itself.
        extra["OpTypesToExcludeOutputQuantization"] = list(ops or _TRT_OPS)
    with tempfile.TemporaryDirectory(prefix="enginekit-qdq-") as tmp:
        src, pre, out = (Path(tmp) / n for n in ("model.onnx", "pre.onnx", "qdq.onnx"))
        cache = Path(tmp) / "ranges.json"
        # Past 1 GiB, weights go to external data files (protobuf stops at 2 GiB).
        large = m.proto.ByteSize() > _LARGE_BYTES
        onnx.save_model(m.proto, str(src), save_as_external_data=large, location="model.data")
        # skip_optimization keeps tensor names (the table's keys) and standard-domain ops.
        quant_pre_process(
            str(src), str(pre), skip_optimization=True, skip_symbolic_shape=not symbolic_shapes,
            save_as_external_data=large, external_data_location="pre.data",
        )  # fmt: skip
        save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), cache)
        try:
            quantize_static(
                str(pre),
                str(out),
                calibration_data_reader=None,
                calibration_cache_path=str(cache),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=ops,
                per_channel=per_channel,
                reduce_range=reduce_range,
                activation_type=QuantType.QInt8 if trt else QuantType.QUInt8,
                weight_type=QuantType.QUInt8 if weight_type == "uint8" else QuantType.QInt8,
                nodes_to_exclude=list(exclude_nodes),
                calibrate_method=CalibrationMethod.MinMax,
                extra_options=extra,
                use_external_data_format=large,
            )
        except KeyError as exc:
            raise CalibrationError(
                f"the quantizer needs a range for tensor {exc} that the table does not have; "
                "was the table made for this model? Recalibrate it"
            ) from None
        proto = onnx.load_model(str(out))
    if trt:
        _residual_adds(proto)
    if reduce_range and per_channel:
        full_range_depthwise(proto, m.proto)
    float_outputs(proto)
    _check_standard_domain(proto)
    proto.doc_string = (
        f"Q/DQ ({style}) by enginekit from calibration table {table.sha256[:16]} "
        f"({table.method}, {table.samples} samples)"
    )
    if path is not None:
        Model(proto, None, "", (), ()).save(path)
    return proto


_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: Ops that mark a transformer block (decomposed LayerNorm shows as ReduceMean + Pow/Sqrt).
_TRANSFORMER_OPS = ("Softmax", "LayerNormalization", "Gelu", "Erf", "Attention")


def is_transformer(proto: onnx.ModelProto) -> bool:
    """Whether the graph holds attention/normalization ops of a transformer block."""
    return any(n.op_type in _TRANSFORMER_OPS for n in proto.graph.node)


def default_op_types(proto: onnx.ModelProto, style: str) -> list[str] | None:
    """The op types ``write_qdq`` quantizes by default (None: every op ORT can quantize).

    In a transformer only the weighted ops (MatMul, Gemm, Conv) get Q/DQ; LayerNorm, Softmax,
    Gelu and every elementwise op stay float. The attention-mask Add is why: its mask input
    holds the dtype's lowest value at padded positions, so its calibrated range spans ~1e38
    and a Q/DQ pair there rounds every attention score to the same level (measured on BERT:
    top-1 agreement 77% with elementwise ops quantized, 89% without). The residual stream's
    outliers (LayerNorm inputs) are the other reason. A CNN keeps its quantized residual Adds:
    their ranges are tame and they keep the int8 path unbroken between convolutions.
    """
    if style == "tensorrt":
        return list(_TRT_OPS)
    if is_transformer(proto):
        return list(_WEIGHTED)
    return None


def float_outputs(proto: onnx.ModelProto) -> None:
    """Drop the Q/DQ pair in front of each graph output: outputs stay float.

    ORT's quantizer quantizes a graph output like any activation; for a classifier that
    rounds the logits to 256 levels over a (possibly clipped) range, ties and clips the top
    classes, and costs top-1 agreement for nothing (the next consumer is the user, in float).
    """
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    dropped: set[int] = set()
    for out in graph.output:
        dq = producer.get(out.name)
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear" or readers.get(q.output[0], 0) != 1:
            continue
        tensor = q.input[0]
        maker = producer.get(tensor)
        if maker is None or readers.get(tensor, 0) != 1:
            continue  # a graph input, or read by others too: leave it
        maker.output[list(maker.output).index(tensor)] = out.name
        dropped.update((id(q), id(dq)))
    if dropped:
        kept = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
        used = {i for n in graph.node for i in n.input}
        inits = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)


def _residual_adds(proto: onnx.ModelProto) -> None:
    """Leave a residual Add's weighted-op input unquantized, as TensorRT wants it.

    ORT quantizes both inputs of an Add. TensorRT fuses ``Add(conv(x), DQ(Q(skip)))`` into the
    Conv when only the skip branch carries Q/DQ; a Q/DQ pair on the Conv's own output would
    make it a separate int8 op. Where both inputs come from weighted ops (a downsampling
    block), the second (the residual branch, by PyTorch's ``out + identity``) keeps its pair.
    Written by hand: ORT's quantizer has no per-input placement.
    """
    nodes = list(proto.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def quantized(name: str) -> tuple[str, onnx.NodeProto, onnx.NodeProto] | None:
        """(float tensor, Q, DQ) when ``name`` is DQ(Q(tensor))."""
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return None
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            return None
        return q.input[0], q, dq

    dropped: set[int] = set()
    for add in nodes:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        pairs = [quantized(i) for i in add.input]
        if pairs[0] is None or pairs[1] is None:
            continue
        weighted = [
            k for k, p in enumerate(pairs)
            if p is not None and getattr(producer.get(p[0]), "op_type", "") in _WEIGHTED
        ]  # fmt: skip
        if not weighted:
            continue
        k = weighted[0]
        tensor, q, dq = pairs[k]  # type: ignore[misc]
        # Only a pair that exists for this Add alone is removed.
        if [len(consumers[t]) for t in (tensor, q.output[0], dq.output[0])] != [1, 1, 1]:
            continue
        add.input[k] = tensor
        dropped.update((id(q), id(dq)))
    kept = [n for n in nodes if id(n) not in dropped]
    del proto.graph.node[:]
    proto.graph.node.extend(kept)


def full_range_depthwise(
    proto: onnx.ModelProto, source: onnx.ModelProto, layers: Collection[str] | None = None
) -> list[str]:
    """Give the depthwise convolutions of a 7-bit-weight (``reduce_range``) Q/DQ model their
    8th weight bit back, in place; the layers changed.

    Why: 7-bit weights exist for the u8*s8 kernels of x86 CPUs without VNNI, which add pairs
    of products in int16 (``vpmaddubsw``) and saturate with 8-bit weights. Depthwise kernels
    do not pair input channels that way (ONNX Runtime's and OpenVINO's widen to 16/32 bits),
    and they are the layers that can least afford a bit: few weights per channel, large
    zero-sum kernels after BatchNorm folding. Measured on MobileNetV2 (ImageNet weights, AVX2;
    output NMSE against fp32 on 160 photo crops): 8-bit depthwise weights run on both ONNX
    Runtime and OpenVINO exactly as the Q/DQ arithmetic says (no saturation) and take the
    output NMSE from 0.055 to 0.038, top-1 agreement 80% -> 83%; 8-bit weights on every
    layer saturate (NMSE 0.10 on ORT, 0.14 on OpenVINO), the first convolution (the image's
    dense, full-range input) most of all. docs/calibration.md has the per-layer table.

    Each changed layer gets symmetric per-channel int8 weights over [-127, 127] and, where the
    bias is int32 (``onnxruntime-cpu`` style), that bias re-quantized at the new scale.
    Layers are matched to ``source`` by node name; anything not in that form is left alone.
    """
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    init = {t.name: t for t in graph.initializer}
    src_nodes = {n.name: n for n in source.graph.node if n.name}
    src_init = {t.name: t for t in source.graph.initializer}
    readers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1

    def dq(name: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        ok = node is not None and node.op_type == "DequantizeLinear"
        return node if ok and all(i in init for i in node.input[1:3]) else None  # type: ignore[union-attr]

    done = []
    for node in graph.node:
        src = src_nodes.get(node.name)
        if node.op_type != "Conv" or src is None or src.input[1] not in src_init:
            continue
        groups = next((int(a.i) for a in src.attribute if a.name == "group"), 1)
        weight = numpy_helper.to_array(src_init[src.input[1]]).astype(np.float64)
        w_dq = dq(node.input[1])
        depthwise = groups > 1 and weight.ndim >= 3 and weight.shape[1] == 1
        if (
            w_dq is None
            or weight.ndim < 3
            or not (node.name in layers if layers is not None else depthwise)
        ):
            continue
        if w_dq.input[0] not in init or readers.get(w_dq.input[0], 0) != 1:
            continue
        old = numpy_helper.to_array(init[w_dq.input[0]])
        if old.dtype != np.int8 or old.shape != weight.shape:
            continue
        if numpy_helper.to_array(init[w_dq.input[1]]).ndim != 1:
            continue  # per-tensor weights: left as quantized
        amax = np.abs(weight.reshape(len(weight), -1)).max(axis=1)
        scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
        shape = (-1,) + (1,) * (weight.ndim - 1)
        q = np.clip(np.round(weight / scale.reshape(shape)), -INT8_MAX, INT8_MAX)
        if len(node.input) > 2 and node.input[2]:
            b_dq, x_dq = dq(node.input[2]), dq(node.input[0])
            if b_dq is not None and x_dq is not None and len(src.input) > 2:
                bias = numpy_helper.to_array(src_init[src.input[2]]).astype(np.float64)
                x_scale = float(numpy_helper.to_array(init[x_dq.input[1]]).reshape(-1)[0])
                b_scale = (x_scale * scale.astype(np.float64)).astype(np.float32)
                limits = np.iinfo(np.int32)
                b_q = np.clip(np.round(bias / b_scale), limits.min, limits.max)
                _set(init, b_dq.input[0], b_q.astype(np.int32))
                _set(init, b_dq.input[1], b_scale)
        _set(init, w_dq.input[0], q.astype(np.int8))
        _set(init, w_dq.input[1], scale)
        done.append(node.name)
    return done


def _set(init: Mapping[str, onnx.TensorProto], name: str, value: np.ndarray) -> None:
    init[name].CopyFrom(numpy_helper.from_array(value, name))


def _check_standard_domain(proto: onnx.ModelProto) -> None:
    other = sorted({f"{n.domain}:{n.op_type}" for n in proto.graph.node if n.domain})
    if other:
        raise CalibrationError(
            f"the Q/DQ model holds non-standard ops {', '.join(other)}; TensorRT would reject "
            "it. Report this with the model"
        )


# -- TensorRT's legacy calibration cache ---------------------------------------------------------

TRT_ALGORITHMS = ("EntropyCalibration2", "EntropyCalibration", "MinMaxCalibration")


def trt_version_number(version: str) -> int:
    """TensorRT's NV_TENSORRT_VERSION for a version string: 8.6.1 -> 8601, 10.3.0 -> 100300."""
    try:
        parts = [int(p) for p in version.split(".")[:3]]
    except ValueError:
        raise CalibrationError(
            f"TensorRT version {version!r}: expected e.g. 8.6.1 or 10.3.0"
        ) from None
    major, minor, patch = [*parts, 0, 0][:3]
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def write_trt_cache(
    table: CalibrationTable,
    path: str | os.PathLike,
    trt_version: str = "10.0.0",
    algorithm: str = "EntropyCalibration2",
) -> Path:
    """TensorRT's calibration cache text: a ``TRT-<version>-<algorithm>`` header, then one
    ``tensor: <hex>`` line per tensor, hex of the big-endian float32 bits of ``amax / 127``.

    TensorRT skips a cache whose header does not match its version and calibrator, so give
    your TensorRT version and the calibrator class you use (IInt8EntropyCalibrator2 ->
    EntropyCalibration2, IInt8MinMaxCalibrator -> MinMaxCalibration).
    """
    if algorithm not in TRT_ALGORITHMS:
        raise CalibrationError(f"algorithm {algorithm!r} is not one of {', '.join(TRT_ALGORITHMS)}")
    lines = [f"TRT-{trt_version_number(trt_version)}-{algorithm}"]
    for name, r in table.tensors.items():
        if ":" in name or "\n" in name:
            raise CalibrationError(f"tensor name {name!r} cannot be written in a TensorRT cache")
        bits = struct.pack(">f", np.float32(r.amax / INT8_MAX if r.amax > 0 else 1.0))
        lines.append(f"{name}: {bits.hex()}")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return path


def read_trt_cache(path: str | os.PathLike) -> tuple[str, dict[str, float]]:
    """Parse a TensorRT calibration cache: (header, tensor name -> scale).

    Raises:
        CalibrationError: not a TensorRT calibration cache.
    """
    text = Path(path).read_text(encoding="ascii", errors="replace").splitlines()
    if not text or not text[0].startswith("TRT-"):
        raise CalibrationError(f"{path}: no TRT-<version>-<algorithm> header line")
    scales = {}
    for number, line in enumerate(text[1:], start=2):
        if not line.strip():
            continue
        name, sep, value = line.rpartition(": ")
        try:
            if not sep:
                raise ValueError("no ': '")
            scales[name] = struct.unpack(">f", bytes.fromhex(value.strip()))[0]
        except (ValueError, struct.error) as exc:
            raise CalibrationError(
                f"{path}:{number}: not 'tensor: <8 hex digits>' ({exc})"
            ) from None
    return text[0], scales


# -- ONNX Runtime's TensorRT execution provider table -------------------------------------------


def write_ort_trt_table(table: CalibrationTable, directory: str | os.PathLike) -> dict[str, Path]:
    """ONNX Runtime's TensorRT EP calibration table, by ORT's own writer.

    Writes ``calibration.flatbuffers`` (what the EP reads: set ``trt_int8_enable`` and
    ``trt_int8_calibration_table_name``), ``calibration.cache`` and ``calibration.json``.
    Each tensor's value is its ``amax``; the EP sets the dynamic range to [-amax, amax].
    """
    from onnxruntime.quantization import write_calibration_table
    from onnxruntime.quantization.calibrate import TensorData

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cache = {
        name: TensorData(lowest=np.float32(-r.amax), highest=np.float32(r.amax))
        for name, r in table.tensors.items()
    }
    write_calibration_table(cache, dir=str(directory))
    names = ("calibration.flatbuffers", "calibration.cache", "calibration.json")
    return {n.split(".")[1]: directory / n for n in names}


def qdq_scales(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    """Scale of every QuantizeLinear in a Q/DQ model, by the tensor it quantizes."""
    init = {t.name: t for t in proto.graph.initializer}
    out = {}
    for node in proto.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[1] in init:
            out[node.input[0]] = onnx.numpy_helper.to_array(init[node.input[1]])
    return out
