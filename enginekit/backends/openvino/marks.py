"""Layers kept in f32 under OpenVINO's bf16 inference precision (the option ``f32_layers``).

Why: bf16 costs top-1 agreement unevenly. On MobileNetV2 (ImageNet weights, 200 photo crops,
Zen 4 with AVX512-BF16) the whole model in bf16 agrees with f32 on 93.5%; with its first
convolution and the first depthwise one (``features.1``, large zero-sum kernels that amplify
their input's rounding) in f32 and the other 51 layers in bf16, on 97.5% (docs/calibration.md).

How: OpenVINO's CPU plugin keeps a node in its original precision when the node carries the
``DisablePrecisionConversion`` runtime attribute. Python cannot create that attribute (a string
set in ``get_rt_info()`` is a plain value the plugin does not read; measured: no kernel changed),
but the IR reader creates it from ``<attribute name="precise" version="0"/>``. The build already
writes the IR and compiles what it reads back, so the marks go into that IR: the artifact's IR
(the fallback compiled on load) and its compiled blob both carry them.

What gets marked for a named ONNX node: the OpenVINO ops its frontend made from it (friendly
name ``NAME`` or ``NAME/...``: a Conv with a bias is a Convolution ``NAME/WithoutBiases`` and an
Add ``NAME``) and the elementwise ops that consume their output (bias, activation, residual Add).
A Convolution marked alone while its fused elementwise consumers stay bf16 made the CPU plugin
fail to compile ("object is not initialized", OpenVINO 2026.4).
"""

from __future__ import annotations

import difflib
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from enginekit.errors import BuildError

#: Ops that run fused into the layer before them on the CPU plugin: they follow its precision.
ELEMENTWISE = frozenset(
    {
        "Add", "Clamp", "Relu", "Multiply", "Subtract", "Minimum", "Maximum", "Swish",
        "Sigmoid", "HSwish", "HSigmoid", "PRelu", "Elu", "Gelu", "Exp", "Tanh",
    }
)  # fmt: skip
_MARK = {"name": "precise", "version": "0"}
_WEIGHTED = ("Convolution", "GroupConvolution", "MatMul", "ConvolutionBackpropData")


def parse_layers(value: Any) -> tuple[str, ...]:
    """The option's value (a list of names or one comma-separated string) as names."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(n, str) for n in items):
        raise BuildError(
            f"openvino option f32_layers={value!r}: expected ONNX node names, as a list or "
            "one comma-separated string"
        )
    return tuple(n.strip() for n in items if n.strip())


def ops_to_mark(ov_model: Any, layers: Iterable[str]) -> tuple[set[str], list[str]]:
    """Friendly names of the ops of ``ov_model`` to keep in f32 for the ONNX nodes ``layers``,
    and which of ``layers`` are quantized in this model (their data input comes through a
    a Q/DQ pair): those stay int8, unmarked.

    Raises:
        BuildError: a name matching no op, with the closest ONNX node name.
    """
    ops = list(ov_model.get_ordered_ops())
    marked: set[str] = set()
    seeds: list[Any] = []
    quantized: list[str] = []
    for layer in layers:
        found = [
            op for op in ops if op.get_friendly_name() in (layer,) or
            op.get_friendly_name().startswith(layer + "/")
        ]  # fmt: skip
        if not found:
            known = sorted({op.get_friendly_name().split("/")[0] for op in ops})
            close = difflib.get_close_matches(layer, known, n=1)
            raise BuildError(
                f"openvino option f32_layers: no node {layer!r} in the model"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + " (give the ONNX node names of the layers to keep in f32)"
            )
        if any(_quantized(op) for op in found):
            quantized.append(layer)
            continue
        seeds.extend(op for op in found if op.get_type_name() != "Constant")
    stack = list(seeds)
    while stack:
        op = stack.pop()
        if op.get_friendly_name() in marked:
            continue
        marked.add(op.get_friendly_name())
        for out in op.outputs():
            for target in out.get_target_inputs():
                consumer = target.get_node()
                if consumer.get_type_name() in ELEMENTWISE:
                    stack.append(consumer)
    return marked, quantized


def _quantized(op: Any) -> bool:
    """Whether ``op`` (a weighted layer) reads its data input from a Q/DQ pair: OpenVINO's
    ONNX frontend makes a DequantizeLinear a Multiply(Subtract(Convert(u8/i8 tensor))), or a
    FakeQuantize."""
    if op.get_type_name() not in _WEIGHTED or op.get_input_size() == 0:
        return False
    node = op.input_value(0).get_node()
    for _ in range(4):
        if node.get_type_name() == "FakeQuantize":
            return True
        if node.get_output_element_type(0).get_type_name() in ("u8", "i8"):
            return True
        if node.get_type_name() not in ("Multiply", "Subtract", "Convert"):
            return False
        node = node.input_value(0).get_node()
    return False


def mark_ir(xml_path: Path, names: set[str]) -> int:
    """Add the f32 mark to the layers ``names`` of the IR at ``xml_path`` (rewritten in place);
    returns how many layers were marked."""
    tree = ET.parse(xml_path)
    count = 0
    for layer in tree.getroot().iter("layer"):
        if layer.get("name") not in names:
            continue
        info = layer.find("rt_info")
        if info is None:
            info = ET.Element("rt_info")
            layer.insert(0, info)
        if not any(a.get("name") == _MARK["name"] for a in info.iter("attribute")):
            ET.SubElement(info, "attribute", _MARK)
        count += 1
    tree.write(xml_path, encoding="utf-8", xml_declaration=True)
    return count


def runtime_precisions(compiled: Any) -> dict[str, str]:
    """Each executed layer of the compiled model (by its original layer names) and the
    precision it runs in (``runtimePrecision`` of the runtime graph)."""
    out = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "originalLayersNames" in info and "runtimePrecision" in info:
            for name in info["originalLayersNames"].astype(str).split(","):
                if name:
                    out[name] = info["runtimePrecision"].astype(str)
    return out


__all__ = ["ELEMENTWISE", "mark_ir", "ops_to_mark", "parse_layers", "runtime_precisions"]
