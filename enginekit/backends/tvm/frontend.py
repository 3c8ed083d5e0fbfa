"""ONNX -> Relax through TVM's Relax ONNX frontend, with the op check done first so that an
unsupported op is reported by name and node instead of deep inside the importer."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from enginekit.backends.tvm.lower import error_line
from enginekit.errors import BuildError
from enginekit.quiet import held_output

if TYPE_CHECKING:
    from enginekit.model import Model

log = logging.getLogger(__name__)

#: Ops the Relax ONNX importer handles outside its converter table.
_DIRECT = frozenset({"If", "Constant"})


def supported_ops() -> list[str]:
    """ONNX op types (default domain) the Relax ONNX frontend of the installed TVM converts."""
    from tvm.relax.frontend.onnx import onnx_frontend

    return sorted(set(onnx_frontend._get_convert_map()) | _DIRECT)


def check_ops(model: Model) -> None:
    """Raise BuildError naming the first node whose op the frontend cannot convert (ops with
    an ONNX function body count as converted: :func:`import_onnx` expands them first).

    Raises:
        BuildError: op type, domain, node name and index, and what to do.
    """
    from enginekit.backends.tvm.expand import expand_functions

    proto, _ = expand_functions(model.proto, set(supported_ops()))
    check_nodes(proto)


def check_nodes(proto: Any) -> None:
    """:func:`check_ops` on a ModelProto as it is (no expansion)."""
    known = set(supported_ops())
    missing = []
    for index, node in enumerate(proto.graph.node):
        domain = node.domain or "ai.onnx"
        if domain not in ("ai.onnx", "") or node.op_type not in known:
            missing.append((index, node, domain))
    if not missing:
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


def _converters() -> dict[str, Any]:
    """enginekit's converters, registered over the stock ones for the ops they fix."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    class Range(onnx_frontend.Range):
        """Range(0, seq, 1) with ``seq`` a symbolic dim: TVM 0.27 gives the result a fresh
        length (``range_len_0``), so position embeddings no longer match the tokens' shape
        and everything after the Add loses its shape (GPT-2's positions). Integer ranges with
        start 0, a constant step and a symbolic limit keep the limit in the length."""

        @classmethod
        def _impl_v12(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            start, limit, delta = (onnx_frontend.get_constant(i, params) for i in inputs)
            steps = [_int_scalar(start), _int_scalar(delta)]
            # From 0 with a positive step the length ceil(limit / step) is never negative
            # for a dim (limit >= 0); other ranges keep the stock conversion.
            if tvm.ir.is_prim_expr(limit) and steps[0] == 0 and (steps[1] or 0) > 0:
                dtype = str(getattr(limit, "dtype", None) or limit.ty)
                if dtype.startswith("int"):
                    return relax.op.arange(0, limit, steps[1], dtype)
            return super()._impl_v12(bb, inputs, attr, params)

    class Clip(onnx_frontend.Clip):
        """Clip (ReLU6 in MobileNets) as Relax maximum/minimum: TVM 0.27 emits it as an
        opaque TIR call, which ConvertLayout cannot see through, so every NHWC conv followed
        by a clip got a transpose on each side (70 in MobileNetV2)."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            low, high = float(attr.get("min", -np.inf)), float(attr.get("max", np.inf))
            if low > -np.inf:
                x = bb.emit(relax.op.maximum(x, relax.const(low, dtype)))
            if high < np.inf:
                x = bb.emit(relax.op.minimum(x, relax.const(high, dtype)))
            return x

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            if len(inputs) > 1 and inputs[1] is not None:
                low = cls._sanitize_nan_clip_bound(bb, inputs[1], for_min=True)
                x = bb.emit(relax.op.maximum(x, low))
            if len(inputs) > 2 and inputs[2] is not None:
                high = cls._sanitize_nan_clip_bound(bb, inputs[2], for_min=False)
                x = bb.emit(relax.op.minimum(x, high))
            return x

    class Resize(onnx_frontend.Resize):
        """Resize whose ``sizes`` is a shape with a symbolic batch (``F.interpolate(size=...)``
        exports Shape(x)[0:2] concatenated with constant H, W): TVM 0.27 reads every entry
        of the shape as an int and fails on the batch var. Only the spatial entries are
        used, so when they are constants the sizes become a plain constant."""

        @classmethod
        def _impl_v18(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            sizes = onnx_frontend.get_constant(inputs[3], params) if len(inputs) > 3 else None
            if isinstance(sizes, relax.ShapeExpr):
                spatial = list(sizes.values)[2:]
                if all(isinstance(v, tvm.tirx.IntImm) for v in spatial):
                    inputs = onnx_frontend.onnx_input(inputs)
                    inputs[3] = relax.const(np.array([0, 0] + [int(v) for v in spatial], np.int64))
            return super()._impl_v18(bb, inputs, attr, params)

    class Gather(onnx_frontend.Gather):
        """Gather(Shape(x), [k]) with a one-element index vector (enginekit's
        make_batch_dynamic reads the batch that way): TVM 0.27 keeps a shape only for a 0-D
        index and otherwise turns it into a runtime tensor, so a later Expand or Reshape to
        it loses every dim (ViT's class token, then "Reshape expects the input tensor to
        have known shape"). A constant 1-D index into a shape stays a shape."""

        @classmethod
        def _impl_v13(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data = inputs[0]
            indices = onnx_frontend.get_constant(inputs[1], params)
            if (
                isinstance(data, relax.ShapeExpr)
                and attr.get("axis", 0) == 0
                and isinstance(indices, tvm.ir.GenericConst)
            ):
                picked = indices.value.numpy()
                dims = list(data.values)
                if (
                    picked.ndim == 1
                    and np.issubdtype(picked.dtype, np.integer)
                    and all(-len(dims) <= int(i) < len(dims) for i in picked)
                ):
                    return relax.ShapeExpr([dims[int(i)] for i in picked])
            return super()._impl_v13(bb, inputs, attr, params)

    class Cosh(onnx_frontend.OnnxOpConverter):
        """cosh(x) = (e^x + e^-x) / 2: TVM 0.27 imports Cosh as ``tirx.cosh``, which its LLVM
        codegen does not know ("unknown intrinsic"), so the build failed at compile time."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _exp_pair(bb, inputs[0], relax.op.add)

    class Sinh(onnx_frontend.OnnxOpConverter):
        """sinh(x) = (e^x - e^-x) / 2, for the same reason as :class:`Cosh`."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            return _exp_pair(bb, inputs[0], relax.op.subtract)

    class HardSigmoid(onnx_frontend.HardSigmoid):
        """max(0, min(1, alpha * x + beta)) as Relax maximum/minimum: the stock converter's
        ``clip`` is opaque to ConvertLayout, like :class:`Clip` (MobileNetV3's
        squeeze-excite and hard-swish left 63 transposes in torchvision's small model)."""

        @classmethod
        def _impl_v1(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            alpha = relax.const(float(attr.get("alpha", 0.2)), dtype)
            beta = relax.const(float(attr.get("beta", 0.5)), dtype)
            y = bb.emit(relax.op.add(relax.op.multiply(x, alpha), beta))
            return _unit_clamp(bb, y, 0.0, 1.0)

    class HardSwish(onnx_frontend.HardSwish):
        """x * max(0, min(6, x + 3)) / 6 without ``clip`` (see :class:`HardSigmoid`)."""

        @classmethod
        def _impl_v14(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            x = inputs[0]
            dtype = x.ty.dtype
            shifted = bb.emit(relax.op.add(x, relax.const(3.0, dtype)))
            gate = _unit_clamp(bb, shifted, 0.0, 6.0)
            return bb.emit(relax.op.multiply(x, relax.op.divide(gate, relax.const(6.0, dtype))))

    class LayerNormalization(onnx_frontend.LayerNormalization):
        """Normalizes over every axis from ``axis`` on, and computes the optional ``Mean`` and
        ``InvStdDev`` outputs: TVM 0.27 takes the axes from the scale's rank (wrong for a
        broadcast scale) and returns the constant 0 for both extra outputs (ONNX's
        layer-norm test cases with them, e.g. axis 0, mismatched). Unused extra outputs are
        removed by dead-code elimination; ``Y`` stays TVM's fused layer_norm."""

        @classmethod
        def _impl_v17(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            data, scale = inputs[0], inputs[1]
            bias = inputs[2] if len(inputs) > 2 else None
            ndim = data.ty.ndim
            if ndim < 0 or scale.ty.shape is None:
                return super()._impl_v17(bb, inputs, attr, params)
            axis = int(attr.get("axis", -1)) % ndim
            axes = list(range(axis, ndim))
            eps = float(attr.get("epsilon", 1e-5))
            dtype = data.ty.dtype
            shape = list(data.ty.shape)[axis:]
            # TVM's layer_norm wants gamma/beta of exactly the normalized shape.
            gamma = bb.emit(relax.op.broadcast_to(scale, shape))
            if bias is not None:
                beta = bb.emit(relax.op.broadcast_to(bias, shape))
            elif all(isinstance(d, tvm.tirx.IntImm) for d in shape):
                beta = relax.const(np.zeros([int(d) for d in shape]), dtype)
            else:
                return super()._impl_v17(bb, inputs, attr, params)
            y = bb.emit(relax.op.nn.layer_norm(data, gamma, beta, axes, eps))
            mean = bb.emit(relax.op.mean(data, axes, keepdims=True))
            centered = bb.emit(relax.op.subtract(data, mean))
            var = bb.emit(relax.op.mean(relax.op.multiply(centered, centered), axes, keepdims=True))
            inv = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, dtype))))
            return relax.Tuple([y, mean, inv])

    return {
        "LayerNormalization": LayerNormalization,
        "HardSigmoid": HardSigmoid,
        "HardSwish": HardSwish,
        "Range": Range,
        "Clip": Clip,
        "Resize": Resize,
        "Gather": Gather,
        "Cosh": Cosh,
        "Sinh": Sinh,
    }


def _unit_clamp(bb: Any, x: Any, low: float, high: float) -> Any:
    """max(low, min(high, x)) in ``x``'s dtype, as two elementwise Relax ops."""
    from tvm import relax

    dtype = x.ty.dtype
    x = bb.emit(relax.op.maximum(x, relax.const(low, dtype)))
    return bb.emit(relax.op.minimum(x, relax.const(high, dtype)))


def _exp_pair(bb: Any, x: Any, combine: Any) -> Any:
    """``combine(e^x, e^-x) / 2`` in ``x``'s dtype."""
    from tvm import relax

    dtype = x.ty.dtype
    pos = bb.emit(relax.op.exp(x))
    neg = bb.emit(relax.op.exp(relax.op.negative(x)))
    return bb.emit(relax.op.multiply(combine(pos, neg), relax.const(0.5, dtype)))


def _int_scalar(value: Any) -> int | None:
    """The Python int in a one-element integer constant, else None."""
    import numpy as np
    import tvm

    if not isinstance(value, tvm.ir.GenericConst):
        return None
    array = value.value.numpy()
    if array.size != 1 or not np.issubdtype(array.dtype, np.integer):
        return None
    return int(array.item())


_IMPORT_LOCK = threading.Lock()


@contextlib.contextmanager
def _registered() -> Iterator[None]:
    """TVM's importer with enginekit's converters in its op table (it has no hook for
    custom converters, so the table function is swapped for the length of one import)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    stock = onnx_frontend._get_convert_map
    ours = _converters()

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


def import_onnx(model: Model, shapes: Mapping[str, tuple[int, ...]] | None = None) -> Any:
    """The model as a Relax IRModule; weights become constants.

    Args:
        model: the ONNX model.
        shapes: static input shapes (for a tuned module); None keeps the model's symbolic
            dims, so one compiled module serves every batch size.

    Raises:
        BuildError: an unsupported op, or the importer failed on the graph.
    """
    from tvm.relax.frontend.onnx import from_onnx

    from enginekit.backends.tvm.expand import constant_values, expand_functions

    proto, expanded = expand_functions(model.proto, set(supported_ops()))
    proto = constant_values(proto)
    if expanded:
        log.info("tvm: expanded to their ONNX function bodies: %s", ", ".join(expanded))
        proto = _folded(proto)
    check_nodes(proto)
    dtypes = {s.name: s.dtype for s in model.inputs}
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
                dtype_dict=dtypes,
                keep_params_in_input=False,
                sanitize_input_names=True,
            )
    except Exception as exc:
        raise BuildError(
            f"TVM's Relax ONNX frontend failed on the model: {type(exc).__name__}: "
            f"{error_line(exc)}. Try another backend, or simplify the model "
            "(e.g. onnxslim) before building."
        ) from None
    return clamp_gather_indices(mod)
