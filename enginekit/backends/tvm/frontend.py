"""ONNX -> Relax through TVM's Relax ONNX frontend, with the op check done first so that an
unsupported op is reported by name and node instead of deep inside the importer."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from enginekit.backends.tvm.converters import converters
from enginekit.backends.tvm.lower import error_line
from enginekit.errors import BuildError
from enginekit.quiet import held_output

if TYPE_CHECKING:
    import numpy as np

    from enginekit.model import Model

log = logging.getLogger(__name__)

#: Ops the Relax ONNX importer handles outside its converter table.
_DIRECT = frozenset({"If", "Constant"})


def supported_ops() -> list[str]:
    """ONNX op types (default domain) the Relax ONNX frontend of the installed TVM converts,
    with enginekit's own converters."""
    from tvm.relax.frontend.onnx import onnx_frontend

    return sorted(set(onnx_frontend._get_convert_map()) | set(converters()) | _DIRECT)


def check_ops(model: Model) -> None:
    """Raise BuildError naming the first node whose op the frontend cannot convert (ops with
    an ONNX function body count as converted: :func:`import_onnx` expands them first).

    Raises:
        BuildError: op type, domain, node name and index, and what to do.
    """
    from enginekit.backends.tvm.loops import passes_condition

    proto, _ = _rewritten(model.proto)
    # A Loop whose trip count comes from value inputs is unrolled at import, once they are
    # bound; one still there then is named by the import's own check.
    check_nodes(proto, skip=passes_condition)


def _rewritten(proto: Any) -> tuple[Any, list[str]]:
    """``proto`` with function ops expanded to their bodies and Scans unrolled (a body may
    hold a Scan, a Scan's body function ops); the op types rewritten."""
    from enginekit.backends.tvm.expand import expand_functions, qlinear_matmuls
    from enginekit.backends.tvm.scan import unroll_scans

    known = set(supported_ops())
    proto = qlinear_matmuls(proto)
    proto, expanded = expand_functions(proto, known)
    if expanded and any(n.op_type == "Scan" for n in proto.graph.node):
        # A body's Scan gets its length from Shape arithmetic that folds once simplified.
        proto = _folded(proto)
    proto, scans = unroll_scans(proto)
    if scans:
        proto, again = expand_functions(proto, known)
        expanded = sorted({*expanded, *again, "Scan"})
    return proto, expanded


def check_nodes(proto: Any, skip: Callable[[Any], bool] | None = None) -> None:
    """:func:`check_ops` on a ModelProto as it is (no expansion); nodes ``skip`` accepts are
    not checked."""
    known = set(supported_ops())
    missing = []
    for index, node in enumerate(proto.graph.node):
        domain = node.domain or "ai.onnx"
        if skip is not None and skip(node):
            continue
        if domain not in ("ai.onnx", "") or node.op_type not in known:
            missing.append((index, node, domain))
    if not missing:
        _check_strings(proto)
        _check_data_dependent(proto)
        _check_constant_inputs(proto)
        return
    index, node, domain = missing[0]
    others = sorted(
        {f"{d}::{n.op_type}" for _, n, d in missing[1:]} - {f"{domain}::{node.op_type}"}
    )
    raise BuildError(
        f"TVM {_version()} cannot convert op {node.op_type!r} (domain {domain}) at node "
        f"{node.name or '<unnamed>'!r} (#{index} of the graph)"
        + (f"; also unsupported: {', '.join(others)}" if others else "")
        + ". Build this model with another backend (e.g. --backend onnxruntime), or rewrite the "
        "op into supported ones before export (`enginekit backends --json` lists what each "
        "backend converts)."
    )


def _check_strings(proto: Any) -> None:
    """Raise BuildError naming the first node that takes a string tensor from the graph's
    inputs (TVM has no string type: its importer failed with "unknown dtype `object`")."""
    from onnx import TensorProto

    strings = {
        v.name for v in proto.graph.input if v.type.tensor_type.elem_type == TensorProto.STRING
    }
    strings |= {t.name for t in proto.graph.initializer if t.data_type == TensorProto.STRING}
    for index, node in enumerate(proto.graph.node):
        name = next((i for i in node.input if i in strings), None)
        if name is not None:
            raise BuildError(
                f"TVM {_version()} cannot compile op {node.op_type!r} at node "
                f"{node.name or '<unnamed>'!r} (#{index} of the graph): its input {name!r} is a "
                "string tensor, a type TVM does not have. Build this model with another "
                "backend (e.g. --backend onnxruntime)."
            )


def _check_data_dependent(proto: Any) -> None:
    """Raise BuildError naming the first node whose output shape depends on values."""
    from enginekit.backends.tvm.converters import DATA_DEPENDENT

    for index, node in enumerate(proto.graph.node):
        if node.op_type in DATA_DEPENDENT:
            raise BuildError(
                f"TVM {_version()} cannot compile op {node.op_type!r} at node "
                f"{node.name or '<unnamed>'!r} (#{index} of the graph): its output's shape "
                f"depends on the input values ({DATA_DEPENDENT[node.op_type]}), which a "
                "compiled TVM program cannot produce. Build this model with another backend "
                "(e.g. --backend onnxruntime)."
            )


#: Inputs TVM 0.27's importer reads as constants (it builds shapes and attributes from them):
#: op -> {input index: what it is}. Fed as a graph input, each failed deep in the importer
#: ("Only constant axes currently supported", "Dynamic pads are not supported yet").
_CONSTANT_INPUTS: dict[str, dict[int, str]] = {
    **{
        f"Reduce{kind}": {1: "axes"}
        for kind in ("Sum", "Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp")
    },
    "ReduceSumSquare": {1: "axes"},
    "Split": {1: "split"},
    "TopK": {1: "k"},
    "Pad": {1: "pads"},
    "Resize": {2: "scales", 3: "sizes"},
}


def _check_constant_inputs(proto: Any) -> None:
    """Raise BuildError naming the first node that takes a value TVM compiles in as a
    constant (reduction axes, split sizes, pads...) from a graph input, fed at run time."""
    weights = {t.name for t in proto.graph.initializer}
    fed = {v.name for v in proto.graph.input} - weights
    for index, node in enumerate(proto.graph.node):
        for i, what in _CONSTANT_INPUTS.get(node.op_type, {}).items():
            if i < len(node.input) and node.input[i] in fed:
                raise BuildError(
                    f"TVM {_version()} cannot take the {what} of op {node.op_type!r} at node "
                    f"{node.name or '<unnamed>'!r} (#{index} of the graph) from the graph "
                    f"input {node.input[i]!r}: it compiles {what} in as a constant. Make "
                    f"{node.input[i]!r} an initializer (a constant) before building, or build "
                    "with another backend (e.g. --backend onnxruntime)."
                )


def _constant(proto: Any, name: str) -> Any:
    from onnx import numpy_helper

    for t in proto.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
    return None


def scalar_reshapes_to_unsqueeze(proto: Any) -> Any:
    """A copy of ``proto`` where ``Reshape(scalar, [1])`` is ``Unsqueeze(scalar, [0])``.

    PyTorch's exporter builds shapes from symbolic dims that way (``4 * batch`` reshaped to
    ``[1]``, then concatenated); TVM 0.27's importer keeps such a scalar as a symbolic
    PrimValue, which its Reshape converter rejects but its Unsqueeze converter accepts. Both
    ops mean the same here, so the model is rewritten before import. Returns ``proto`` itself
    when there is nothing to rewrite.
    """
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    reshapes = [n for n in proto.graph.node if n.op_type == "Reshape" and len(n.input) == 2]
    if not reshapes:
        return proto
    inferred = onnx.shape_inference.infer_shapes(proto)
    rank = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in list(inferred.graph.value_info) + list(inferred.graph.input)
        if v.type.tensor_type.HasField("shape")
    }
    targets = []
    for node in reshapes:
        shape = _constant(proto, node.input[1])
        if (
            rank.get(node.input[0]) == 0
            and shape is not None
            and np.array_equal(np.ravel(shape), [1]) | np.array_equal(np.ravel(shape), [-1])
        ):
            targets.append(node.name or node.output[0])
    if not targets:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    axes = "enginekit_unsqueeze_axes_0"
    out.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    for i, node in enumerate(out.graph.node):
        if node.op_type == "Reshape" and (node.name or node.output[0]) in targets:
            new = helper.make_node(
                "Unsqueeze", [node.input[0], axes], list(node.output), name=node.name
            )
            out.graph.node.remove(node)
            out.graph.node.insert(i, new)
    return out


def clamp_gather_indices(mod: Any) -> Any:
    """``take`` (ONNX Gather) in mode ``clip`` instead of the importer's ``fast``.

    ``fast`` compiles to an unchecked load: an out-of-range token id would read outside the
    table (TVM warns that it "segfaults when there are out-of-bounds indices"). ``clip``
    clamps the index instead; ONNX Runtime raises on such input, which a compiled kernel
    cannot do.
    """
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class ClampTake(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            op = call.op
            if isinstance(op, tvm.ir.Op) and op.name == "relax.take" and call.attrs.mode == "fast":
                return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
            return call

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = ClampTake().visit_expr(func)
    return mod


_IMPORT_LOCK = threading.Lock()


@contextlib.contextmanager
def _registered() -> Iterator[None]:
    """TVM's importer with enginekit's converters in its op table (it has no hook for
    custom converters, so the table function is swapped for the length of one import)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    stock = onnx_frontend._get_convert_map
    ours = converters()

    def convert_map() -> dict[str, Any]:
        return {**stock(), **ours}

    with _IMPORT_LOCK:
        onnx_frontend._get_convert_map = convert_map
        try:
            yield
        finally:
            onnx_frontend._get_convert_map = stock


def _folded(proto: Any) -> Any:
    """``proto`` simplified again after expansion (function bodies compute sizes from
    ``Shape``, which TVM's importer cannot divide; with static dims they fold to constants),
    or as it is where simplification fails."""
    from enginekit.errors import EnginekitError
    from enginekit.passes.graph import simplify

    try:
        return simplify(proto)
    except EnginekitError as exc:
        log.info("tvm: the expanded model is imported unsimplified: %s", exc)
        return proto


def _version() -> str:
    import tvm

    return str(tvm.__version__)


def import_onnx(
    model: Model,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """The model as a Relax IRModule; weights become constants.

    Args:
        model: the ONNX model.
        shapes: static input shapes (for a tuned module); None keeps the model's symbolic
            dims, so one compiled module serves every batch size.
        values: values of value inputs (:mod:`enginekit.backends.tvm.values`), compiled in as
            constants; those inputs are no longer the program's.

    Raises:
        BuildError: an unsupported op, or the importer failed on the graph.
    """
    proto = bound(model.proto, values) if values else model.proto
    dtypes = {s.name: s.dtype for s in model.inputs if not values or s.name not in values}
    return import_proto(proto, dtypes, shapes)


def bound(proto: Any, values: Mapping[str, np.ndarray]) -> Any:
    """``proto`` with the value inputs as initializers holding ``values``, simplified again:
    what was computed from them (sizes, pads, crop windows, often through ``Shape`` and
    ``Concat``) folds to the constants TVM's importer needs."""
    from enginekit.backends.values import bind

    return _folded(bind(proto, values))


def import_proto(
    source: Any,
    dtypes: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> Any:
    """:func:`import_onnx` on a ModelProto whose graph inputs have the ``dtypes`` given."""
    from tvm.relax.frontend.onnx import from_onnx

    from enginekit.backends.tvm.branches import taken_branches
    from enginekit.backends.tvm.expand import constant_values
    from enginekit.backends.tvm.loops import unroll_loops

    proto, expanded = _rewritten(source)
    proto = constant_values(proto)
    proto, taken = taken_branches(proto)
    proto, loops = unroll_loops(proto)
    if expanded:
        log.info("tvm: rewritten into simpler ops: %s", ", ".join(expanded))
    if expanded or taken or loops:
        proto = _folded(proto)
    check_nodes(proto)
    try:
        # The frontend re-runs onnx.checker and turns its complaints into warnings, and prints
        # "Error converting operator ..." itself: the BuildError below says it once.
        with (
            warnings.catch_warnings(),
            _registered(),
            held_output("TVM frontend", False),
        ):
            warnings.simplefilter("ignore")
            mod = from_onnx(
                scalar_reshapes_to_unsqueeze(proto),
                shape_dict={k: list(v) for k, v in shapes.items()} if shapes else None,
                dtype_dict=dict(dtypes),
                keep_params_in_input=False,
                sanitize_input_names=True,
            )
    except BuildError:
        raise  # enginekit's converters name the op and node themselves
    except Exception as exc:
        raise BuildError(
            f"TVM's Relax ONNX frontend failed on the model: {type(exc).__name__}: "
            f"{error_line(exc)}. Try another backend, or simplify the model "
            "(e.g. onnxslim) before building."
        ) from None
    return clamp_gather_indices(mod)
