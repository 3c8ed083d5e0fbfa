"""``If`` nodes whose condition is known before import, replaced by the branch they take.

TVM 0.27's importer converts both branches of every ``If`` and joins them, which fails where a
branch holds what only the taken one can build: ONNX's ``AffineGrid`` body (the
``*_expanded`` test models) tests the rank of its ``size`` and builds a 2-D grid in one branch
and a 3-D one in the other ("Check failed: (tensor_ty) is false", "'NoneType' object has no
attribute 'values'"). With ``size`` a value input bound to a constant, the condition is a
constant too: it is computed here (ONNX's reference implementation, on the small constants it
depends on and on the static shapes shape inference finds) and the ``If`` becomes the taken
branch's nodes. A condition computed from run-time data leaves the ``If`` to TVM.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Constants larger than this many elements are not evaluated (conditions come from shapes).
MAX_ELEMENTS = 4096
#: Rounds of inlining (a taken branch may hold an ``If`` of its own).
MAX_ROUNDS = 4
#: Ops never evaluated at build time: their values differ between runs.
_RANDOM = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip


def _constants(proto: Any) -> dict[str, Any]:
    """Values known before import: small initializers and ``Constant``s, static shapes
    (``Shape``/``Size`` of a value whose shape inference gives every dim), and what the
    main graph's plain nodes compute from them alone."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    from enginekit.backends.tvm.expand import _opset, _types

    opsets = {(o.domain or ""): int(o.version) for o in proto.opset_import}
    types = _types(proto)
    known: dict[str, Any] = {}
    for t in proto.graph.initializer:
        if int(np.prod(t.dims)) <= MAX_ELEMENTS:
            known[t.name] = numpy_helper.to_array(t)

    def static_shape(name: str) -> list[int] | None:
        t = types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        dims = t.tensor_type.shape.dim
        return (
            [int(d.dim_value) for d in dims] if all(d.HasField("dim_value") for d in dims) else None
        )

    for node in proto.graph.node:
        if (node.domain or "") not in ("", "ai.onnx") or node.op_type in _RANDOM:
            continue
        if any(a.HasField("g") or a.graphs for a in node.attribute):
            continue
        if node.op_type in ("Shape", "Size") and node.input[0] not in known:
            shape = static_shape(node.input[0])
            if shape is None or any(a.name in ("start", "end") for a in node.attribute):
                continue
            value = np.array(shape if node.op_type == "Shape" else int(np.prod(shape)), np.int64)
            known[node.output[0]] = value
            continue
        if not all(i in known for i in node.input if i):
            continue
        try:
            outs = ReferenceEvaluator(node, opsets={"": _opset(proto, "") or 1, **opsets}).run(
                None, {i: known[i] for i in node.input if i}
            )
        except Exception as exc:  # the reference cannot evaluate it: the value stays unknown
            log.debug("tvm: %s not evaluated before import: %s", node.op_type, exc)
            continue
        for name, value in zip(node.output, outs):
            if name and isinstance(value, np.ndarray) and value.size <= MAX_ELEMENTS:
                known[name] = value
    return known


def taken_branches(proto: Any) -> tuple[Any, int]:
    """``proto`` with every main-graph ``If`` whose condition is known replaced by the nodes
    of the branch it takes (their names prefixed, the branch's outputs passed on through
    ``Identity``).

    Returns:
        (the model, or ``proto`` itself when no ``If`` was replaced; how many were).
    """
    import numpy as np
    import onnx
    from onnx import helper

    from enginekit.backends.tvm.expand import _renamed
    from enginekit.backends.tvm.scan import _produced

    out, done = proto, 0
    for round_ in range(MAX_ROUNDS):
        if not any(n.op_type == "If" for n in out.graph.node):
            break
        known = _constants(out)
        new: list[Any] = []
        inits: list[Any] = []
        changed = False
        for index, node in enumerate(out.graph.node):
            cond = known.get(node.input[0]) if node.op_type == "If" else None
            if cond is None or np.size(cond) != 1:
                new.append(node)
                continue
            name = "then_branch" if bool(np.ravel(cond)[0]) else "else_branch"
            [branch] = [a.g for a in node.attribute if a.name == name]
            prefix = f"enginekit_if{index}_r{round_}_"
            inner = _produced(branch)

            def rename(n: str, inner: set[str] = inner, prefix: str = prefix) -> str:
                return prefix + n if n in inner else n

            new.extend(_renamed(n, rename, {}) for n in branch.node)
            for t in branch.initializer:
                copy = onnx.TensorProto()
                copy.CopyFrom(t)
                copy.name = rename(t.name)
                inits.append(copy)
            for value, result in zip(branch.output, node.output):
                if result:
                    new.append(helper.make_node("Identity", [rename(value.name)], [result]))
            changed = True
            done += 1
        if not changed:
            break
        if out is proto:
            out = onnx.ModelProto()
            out.CopyFrom(proto)
        del out.graph.node[:]
        out.graph.node.extend(new)
        out.graph.initializer.extend(inits)
    if done:
        log.info("tvm: %d If node(s) replaced by the branch their known condition takes", done)
        out = _known_as_constants(out)
    return out, done


def _known_as_constants(proto: Any) -> Any:
    """``proto`` with every main-graph node whose outputs are all known before import
    (:func:`_constants`) replaced by ``Constant`` nodes. A taken branch computes sizes from
    the ``Shape`` of its values, which TVM's importer carries as run-time shapes it cannot
    build tensors of (AffineGrid's ``ConstantOfShape(Shape(...))``: "Check failed:
    (tensor_ty) is false")."""
    import onnx
    from onnx import helper, numpy_helper

    known = _constants(proto)
    weights = {t.name for t in proto.graph.initializer}
    new = []
    for node in proto.graph.node:
        outs = [o for o in node.output if o]
        if node.op_type == "Constant" or not outs or not all(o in known for o in outs):
            new.append(node)
            continue
        for o in outs:
            if o not in weights:
                value = numpy_helper.from_array(known[o])
                new.append(helper.make_node("Constant", [], [o], value=value))
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.node[:]
    out.graph.node.extend(new)
    return out
