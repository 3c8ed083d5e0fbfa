"""ONNX ops TVM's importer lacks, replaced by their ONNX function bodies before import.

Many ONNX ops (``Celu``, ``Swish``, the standard ``Attention``, ``CenterCropPad``,
``NegativeLogLikelihoodLoss``...) are defined by the standard as *functions*: a body of
simpler ops in the op's schema, the same expansion onnx's own ``*_expanded`` test models use.
Where TVM 0.27's Relax frontend has no converter for such an op, the node is replaced by that
body (for the model's opset, with the node's attributes and input types), repeatedly, until
every op is one TVM converts or one with no body (which :func:`frontend.check_ops` then names).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Default-domain ops expanded even though TVM has a converter by that name: TVM's
#: ``Attention`` converter is for com.microsoft's Attention (it reads a ``num_heads``
#: attribute the standard op (opset 23) does not have).
ALWAYS = frozenset({"Attention"})
#: Expansion rounds (a body may use another function op): enough for the standard's nesting.
MAX_ROUNDS = 4


def _opset(proto: Any, domain: str) -> int | None:
    for imp in proto.opset_import:
        if (imp.domain or "") == domain or (domain == "" and imp.domain == "ai.onnx"):
            return int(imp.version)
    return None


def _types(proto: Any) -> dict[str, Any]:
    """Every value's TypeProto the model states or shape inference finds."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # inference is an aid here, not a requirement
        inferred = proto
    graph = inferred.graph
    types = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]}
    for init in graph.initializer:
        if init.name not in types:
            types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, init.dims)
    return types


def function_body(node: Any, opset: int, types: dict[str, Any]) -> Any | None:
    """The FunctionProto defining ``node`` at ``opset``, or None (no body, or not for these
    inputs)."""
    import onnx

    try:
        # Typed Any: onnx's stubs lack the per-opset function accessors it has.
        schema: Any = onnx.defs.get_schema(node.op_type, opset, domain=node.domain or "")
    except Exception:  # not a standard op
        return None
    plain = [v for v in schema.function_opset_versions if v <= opset]
    context = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    body = onnx.FunctionProto()
    try:
        if plain and (not context or max(plain) >= max(context)):
            body.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        elif context:
            if any(i and i not in types for i in node.input):
                return None  # the body depends on input types that are unknown here
            inputs = [types[i].SerializeToString() if i else b"" for i in node.input]
            data = schema.get_context_dependent_function_with_opset_version(
                max(context), node.SerializeToString(), inputs
            )
            body.ParseFromString(data)
        else:
            return None
    except Exception as exc:  # the schema refuses these attributes or types
        log.debug("no function body for %s: %s", node.op_type, exc)
        return None
    return body if body.node else None


def _renamed(node: Any, rename: Callable[[str], str], attrs: dict[str, Any]) -> Any:
    """A copy of a body node with its edges renamed and attribute references resolved."""
    import onnx

    out = onnx.NodeProto()
    out.CopyFrom(node)
    out.name = rename(node.name or node.output[0])
    del out.input[:]
    out.input.extend(rename(i) for i in node.input)
    del out.output[:]
    out.output.extend(rename(o) for o in node.output)
    del out.attribute[:]
    for attr in node.attribute:
        if attr.ref_attr_name:
            if attr.ref_attr_name not in attrs:
                continue  # not given on the node: the body op's default applies
            value = onnx.AttributeProto()
            value.CopyFrom(attrs[attr.ref_attr_name])
            value.name = attr.name
            out.attribute.append(value)
            continue
        copy = onnx.AttributeProto()
        copy.CopyFrom(attr)
        if copy.HasField("g"):
            _rename_graph(copy.g, rename, attrs)
        for g in copy.graphs:
            _rename_graph(g, rename, attrs)
        out.attribute.append(copy)
    return out


def _rename_graph(graph: Any, rename: Callable[[str], str], attrs: dict[str, Any]) -> None:
    nodes = [_renamed(n, rename, attrs) for n in graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in [*graph.input, *graph.output]:
        value.name = rename(value.name)


def inline(node: Any, body: Any, prefix: str, opset: int | None = None) -> list[Any]:
    """``body``'s nodes wired to ``node``'s inputs and outputs (internal names prefixed).

    An attribute reference the node does not set takes the op's default from its schema at
    ``opset`` (as ONNX's own inliner does), not the body op's: HammingWindow's body casts
    to ``@output_datatype`` and reads ``@periodic`` into a Constant, which without the
    defaults were a Cast with no ``to`` and an empty Constant."""
    names = {formal: node.input[i] if i < len(node.input) else "" for i, formal in
             enumerate(body.input)}  # fmt: skip
    for i, formal in enumerate(body.output):
        if i < len(node.output) and node.output[i]:
            names[formal] = node.output[i]

    def rename(name: str) -> str:
        if name in names:
            return names[name]
        return prefix + name if name else ""

    attrs = {**_defaults(node, opset), **{a.name: a for a in node.attribute}}
    return [_renamed(n, rename, attrs) for n in body.node]


def _defaults(node: Any, opset: int | None) -> dict[str, Any]:
    """The attributes of ``node``'s op schema at ``opset`` that have a default, by name."""
    import onnx

    if opset is None:
        return {}
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain=node.domain or "")
    except Exception:  # not a standard op: no defaults to add
        return {}
    return {
        name: attr.default_value
        for name, attr in schema.attributes.items()
        if attr.default_value.type != onnx.AttributeProto.UNDEFINED
    }


def expand_functions(proto: Any, known: Collection[str]) -> tuple[Any, list[str]]:
    """``proto`` with every default-domain node whose op is not in ``known`` and has an ONNX
    function body replaced by that body.

    Returns:
        (the model, or ``proto`` itself when nothing was expanded; the op types expanded).
    """
    import onnx

    known = set(known) - ALWAYS
    opset = _opset(proto, "")
    if opset is None or all(n.op_type in known for n in proto.graph.node):
        return proto, []
    out = proto
    expanded: list[str] = []
    for round_ in range(MAX_ROUNDS):
        nodes = list(out.graph.node)
        todo = [
            i for i, n in enumerate(nodes)
            if (n.domain or "") in ("", "ai.onnx") and n.op_type not in known
        ]  # fmt: skip
        types = _types(out) if todo else {}
        bodies = {i: function_body(nodes[i], opset, types) for i in todo}
        found = {i: b for i, b in bodies.items() if b is not None}
        if not found:
            break
        new: list[Any] = []
        imports = []
        for i, node in enumerate(nodes):
            body = found.get(i)
            if body is None:
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                new.append(copy)
                continue
            expanded.append(node.op_type)
            new.extend(inline(node, body, f"{node.op_type}_{i}_r{round_}_", opset))
            imports += [m for m in body.opset_import if (m.domain or "") not in ("", "ai.onnx")]
        if out is proto:
            out = onnx.ModelProto()
            out.CopyFrom(proto)
        del out.graph.node[:]
        out.graph.node.extend(new)
        for imp in imports:
            if _opset(out, imp.domain) is None:
                out.opset_import.append(imp)
    return out, sorted(set(expanded))


#: Constant's one-value attributes and the tensor each becomes (TVM reads only ``value``).
_CONSTANT_ATTRS = {
    "value_float": ("f", "float32", False),
    "value_floats": ("floats", "float32", True),
    "value_int": ("i", "int64", False),
    "value_ints": ("ints", "int64", True),
}


def constant_values(proto: Any) -> Any:
    """``Constant`` nodes given by ``value_float``/``value_int``(s) rewritten to a ``value``
    tensor: TVM 0.27's importer reads only ``value`` ("no value in Constant"), and function
    bodies (``Swish``'s alpha) and some exporters use the others. Returns ``proto`` itself when
    there is none."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    def plain(node: Any) -> bool:
        return node.op_type != "Constant" or not any(
            a.name in _CONSTANT_ATTRS for a in node.attribute
        )

    def nodes(graph: Any) -> Iterator[Any]:
        """Every node of ``graph``, those of its subgraphs (If branches) included."""
        for node in graph.node:
            yield node
            for a in node.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from nodes(g)

    if all(plain(n) for n in nodes(proto.graph)):
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for node in nodes(out.graph):
        if plain(node):
            continue
        [attr] = [a for a in node.attribute if a.name in _CONSTANT_ATTRS]
        field, dtype, many = _CONSTANT_ATTRS[attr.name]
        value = np.array(list(getattr(attr, field)) if many else getattr(attr, field), dtype)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))
    return out


def qlinear_matmuls(proto: Any) -> Any:
    """``QLinearMatMul`` nodes with one scale and zero point per operand rewritten to
    ``DequantizeLinear`` x 2, ``MatMul``, ``QuantizeLinear`` (TVM 0.27 has no converter, and
    has all four). The product of the dequantized integers is exact in float32 for the
    small K of such layers; per-row/column scales are left to the op check, which names the
    node. Returns ``proto`` itself when there is none."""
    import onnx
    from onnx import helper

    nodes = list(proto.graph.node)
    if not any(n.op_type == "QLinearMatMul" for n in nodes):
        return proto
    types = _types(proto)

    def scalar(name: str) -> bool:
        t = types.get(name)
        if t is None or not t.tensor_type.HasField("shape"):
            return False
        dims = t.tensor_type.shape.dim
        return all(d.HasField("dim_value") and d.dim_value == 1 for d in dims)

    new = []
    for i, node in enumerate(nodes):
        if node.op_type != "QLinearMatMul" or not all(
            scalar(n) for n in node.input[1:3] + node.input[4:8]
        ):
            new.append(node)
            continue
        a, a_s, a_z, b, b_s, b_z, y_s, y_z = node.input
        tag = f"enginekit_qlmm{i}_"
        # Scales cast to float32 first: with float16 scales the float16 product lost the
        # exactness of the integer sums (ONNX's uint8/float16 cases differed by one level).
        f32 = onnx.TensorProto.FLOAT
        new += [
            helper.make_node("Cast", [a_s], [tag + "as"], to=f32),
            helper.make_node("Cast", [b_s], [tag + "bs"], to=f32),
            helper.make_node("Cast", [y_s], [tag + "ys"], to=f32),
            helper.make_node("DequantizeLinear", [a, tag + "as", a_z], [tag + "a"]),
            helper.make_node("DequantizeLinear", [b, tag + "bs", b_z], [tag + "b"]),
            helper.make_node("MatMul", [tag + "a", tag + "b"], [tag + "y"]),
            helper.make_node(
                "QuantizeLinear", [tag + "y", tag + "ys", y_z], list(node.output), name=node.name
            ),
        ]
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.node[:]
    out.graph.node.extend(new)
    return out
