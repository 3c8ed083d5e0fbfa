"""ONNX ``Loop`` unrolled into copies of its body before import, where its trip count is known
and its condition stays true: TVM 0.27's Relax importer has no Loop converter. Standard
function bodies are written with such Loops (``Range``'s, whose trip count is computed from
``start``, ``limit`` and ``delta``: value inputs, bound to constants before import).

Each iteration is a copy of the body with the iteration number a constant and the carried
values wired to the previous copy's; scan outputs are ``Unsqueeze``d and concatenated. A Loop
whose trip count is unknown, 0 with scan outputs, or past :data:`MAX_STEPS`, or whose body
computes its condition, is left as it is, and the op check then names it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Most iterations unrolled: each copies the body.
MAX_STEPS = 256


def passes_condition(node: Any) -> bool:
    """Whether ``node`` is a Loop whose body hands its condition on unchanged (so it stays
    what the Loop is given) and that has a trip count: one :func:`unroll_loops` can unroll
    once the trip count and condition are known."""
    from enginekit.backends.tvm.scan import _attr

    if node.op_type != "Loop" or not node.input or not node.input[0]:
        return False
    body = _attr(node, "body", None)
    if body is None or len(body.input) < 2 or not body.output:
        return False
    cond_in, cond_out = body.input[1].name, body.output[0].name
    if cond_out == cond_in:
        return True
    return any(
        n.op_type == "Identity" and list(n.input) == [cond_in] and list(n.output) == [cond_out]
        for n in body.node
    )


def unroll_loops(proto: Any) -> tuple[Any, int]:
    """``proto`` with every main-graph Loop of a known trip count and a condition that stays
    true unrolled.

    Returns:
        (the model, or ``proto`` itself when nothing was unrolled; how many Loops were).
    """
    import numpy as np
    import onnx

    from enginekit.backends.tvm.branches import _constants
    from enginekit.backends.tvm.expand import _opset

    if not any(passes_condition(n) for n in proto.graph.node):
        return proto, 0
    known = _constants(proto)
    opset = _opset(proto, "") or 0
    new: list[Any] = []
    inits: list[Any] = []
    done = 0
    for index, node in enumerate(proto.graph.node):
        trips = known.get(node.input[0]) if passes_condition(node) else None
        cond = known.get(node.input[1]) if len(node.input) > 1 and node.input[1] else True
        steps = None
        if trips is not None and np.size(trips) == 1 and cond is not None:
            count = int(np.ravel(trips)[0]) if bool(np.ravel(cond)[0]) else 0
            steps = _unrolled(node, index, count, opset, inits)
        if steps is None:
            new.append(node)
            continue
        new.extend(steps)
        done += 1
    if not done:
        return proto, 0
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.node[:]
    out.graph.node.extend(new)
    out.graph.initializer.extend(inits)
    log.info("tvm: unrolled %d Loop node(s)", done)
    return out, done


def _unrolled(node: Any, index: int, count: int, opset: int, inits: list[Any]) -> list[Any] | None:
    """The nodes replacing one Loop run ``count`` times, or None when it stays."""
    import numpy as np
    from onnx import helper, numpy_helper

    from enginekit.backends.tvm.scan import _attr, _produced, hoist_initializers, unroll_step

    body = _attr(node, "body", None)
    n = len(node.input) - 2  # loop-carried values
    k = len(body.output) - 1 - n  # scan outputs
    wanted = [j for j in range(k) if n + j < len(node.output) and node.output[n + j]]
    if count < 0 or count > MAX_STEPS or (count == 0 and wanted):
        return None
    tag = f"enginekit_loop{index}_"
    local = _produced(body)
    shared = hoist_initializers(body, tag, inits)
    nodes: list[Any] = []
    cond = node.input[1] if len(node.input) > 1 else ""
    if not cond:  # no condition given: true
        cond = f"{tag}true"
        inits.append(numpy_helper.from_array(np.array(True), cond))
    states = list(node.input[2:])
    slices: list[list[str]] = [[] for _ in range(k)]
    for t in range(count):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"{tag}i{t}"))
        names = {body.input[0].name: f"{tag}i{t}", body.input[1].name: cond}
        names.update({body.input[2 + i].name: states[i] for i in range(n)})
        resolved = unroll_step(body, names, shared, local, f"{tag}t{t}_", nodes)
        states = resolved[1 : 1 + n]
        for j in range(k):
            slices[j].append(resolved[1 + n + j])
    for i in range(n):
        if i < len(node.output) and node.output[i]:
            nodes.append(helper.make_node("Identity", [states[i]], [node.output[i]]))
    for j in wanted:
        grown = []
        for t, name in enumerate(slices[j]):
            g = f"{tag}out{j}_{t}"
            if opset >= 13:
                axes = f"{tag}axes"
                if not any(i.name == axes for i in inits):
                    inits.append(numpy_helper.from_array(np.array([0], np.int64), axes))
                nodes.append(helper.make_node("Unsqueeze", [name, axes], [g]))
            else:
                nodes.append(helper.make_node("Unsqueeze", [name], [g], axes=[0]))
            grown.append(g)
        nodes.append(helper.make_node("Concat", grown, [node.output[n + j]], axis=0))
    return nodes
