"""Verification inputs the model accepts: valid values for integer inputs that are shapes or indices.

Random 0/1 integers are fine for masks and most ids, but not where an integer input reaches a
shape or index position: ``Expand(x, shape)`` with a shape of zeros, ``Gather(w, ids)`` with ids
past the vocabulary, a ``Range`` limit, a ``TopK`` k of 0. :func:`make_feeds` walks the graph
from each integer input through value-preserving ops (Cast, Identity, Unsqueeze, Squeeze,
Reshape, Flatten, Concat, ...) to the positions it reaches, and gives it values valid there:
indices in ``[0, dim)`` of the indexed dim (a token id below the vocabulary size), a shape
taken from the data it reshapes, ones for Expand/Tile, 1 for a TopK k, 0 for Slice starts.
Where the walk passes through arithmetic or the rule is unknown, a few candidates are tried on
the reference; when none runs, :class:`~enginekit.errors.BuildError` asks for ``verify_data=``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from enginekit.errors import BuildError
from enginekit.model import Model, random_feeds

log = logging.getLogger(__name__)

#: Ops that hand an input's values on unchanged (maybe rearranged) from the given input slot.
_PASS = {
    "Cast": (0,), "CastLike": (0,), "Identity": (0,), "Unsqueeze": (0,), "Squeeze": (0,),
    "Reshape": (0,), "Flatten": (0,), "Transpose": (0,), "Concat": None, "Expand": (0,),
    "Tile": (0,), "Slice": (0,), "Gather": (0,), "Abs": (0,), "Max": None, "Min": None,
}  # fmt: skip
#: Ops that change the values (shape arithmetic): followed, but the result is only a guess.
_ARITH = {"Add", "Sub", "Mul", "Div", "Neg", "Mod", "ReduceProd", "ReduceSum", "Clip"}

#: (op, input slot) -> what the value must be there.
_POSITIONS = {
    ("Gather", 1): "index", ("GatherElements", 1): "index", ("ScatterElements", 1): "index",
    ("Scatter", 1): "index", ("GatherND", 1): "index_nd", ("ScatterND", 1): "index_nd",
    ("OneHot", 0): "onehot_index", ("OneHot", 1): "positive",
    ("Reshape", 1): "reshape", ("Expand", 1): "ones", ("Tile", 1): "ones",
    ("ConstantOfShape", 0): "positive", ("Range", 0): "zero", ("Range", 1): "positive",
    ("Range", 2): "one", ("Slice", 1): "zero", ("Slice", 2): "end", ("Slice", 3): "axes",
    ("Slice", 4): "one", ("TopK", 1): "one", ("Unsqueeze", 1): "axes", ("Pad", 1): "zero",
    ("Pad", 3): "axes", ("Resize", 3): "data_shape", ("Upsample", 1): "ones",
    ("CumSum", 1): "zero", ("Div", 1): "nonzero", ("Mod", 1): "nonzero",
    ("Squeeze", 1): "unknown", ("Split", 1): "unknown", ("ReduceSum", 1): "axes",
    ("ReduceMean", 1): "axes", ("ReduceMax", 1): "axes", ("ReduceMin", 1): "axes",
    ("ReduceProd", 1): "axes", ("NonMaxSuppression", 2): "one", ("Trilu", 1): "zero",
    ("ReverseSequence", 1): "seq_len", ("Compress", 1): "unknown", ("RandomNormalLike", 0): "any",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Use:
    """Where an integer input's values arrive: ``node`` (its name or op) at input ``slot``,
    reached unchanged (``exact``) or through arithmetic (a guess)."""

    input: str
    op: str
    node: str
    slot: int
    kind: str
    exact: bool
    inputs: tuple[str, ...]  # the node's inputs; the first is the tensor indexed, reshaped, ...
    axis: int = 0
    batch_dims: int = 0

    def describe(self) -> str:
        how = "" if self.exact else " (through shape arithmetic)"
        return f"input {self.input!r} reaches {self.op} {self.node!r} input {self.slot}{how}"


def find_uses(proto: onnx.ModelProto, names: list[str]) -> dict[str, list[Use]]:
    """Per input name, the shape and index positions its values reach in the main graph."""
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in proto.graph.node:
        for slot, name in enumerate(node.input):
            if name:
                consumers.setdefault(name, []).append((node, slot))
    uses: dict[str, list[Use]] = {}
    for name in names:
        found: list[Use] = []
        seen: set[tuple[str, bool]] = set()
        todo = [(name, True)]
        while todo:
            tensor, exact = todo.pop()
            if (tensor, exact) in seen or len(seen) > 2000:
                continue
            seen.add((tensor, exact))
            for node, slot in consumers.get(tensor, []):
                kind = _POSITIONS.get((node.op_type, slot))
                if kind is not None and kind != "any":
                    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                    found.append(
                        Use(
                            name, node.op_type, node.name or node.op_type, slot, kind, exact,
                            tuple(node.input), int(attrs.get("axis", 0)),
                            int(attrs.get("batch_dims", 0)),
                        )
                    )  # fmt: skip
                passing = _PASS.get(node.op_type, ())
                if node.op_type in _PASS and (passing is None or slot in passing):
                    # Concat mixes the value with others: what arrives is no longer all of it.
                    keep = exact and node.op_type not in ("Concat", "Max", "Min")
                    todo.extend((out, keep) for out in node.output if out)
                elif node.op_type in _ARITH:
                    todo.extend((out, False) for out in node.output if out)
        if found:
            uses[name] = found
    return uses


def _known_shapes(model: Model, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple]:
    """Static shapes of the graph's tensors with the inputs at ``shapes`` (onnx shape
    inference on a copy whose large weights are typed inputs, so nothing big is copied)."""
    known: dict[str, tuple] = {k: tuple(v) for k, v in shapes.items()}
    known.update((init.name, tuple(init.dims)) for init in model.proto.graph.initializer)
    try:
        inferred = _infer_light(model, shapes)
    except Exception as exc:  # an inference failure leaves the walk with fewer known dims
        log.debug("%s: shape inference for verification inputs failed: %s", model.label, exc)
        return known
    for vi in inferred.graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            known[vi.name] = tuple(int(d.dim_value) for d in dims)
    return known


def _infer_light(model: Model, shapes: Mapping[str, tuple[int, ...]]) -> onnx.ModelProto:
    graph = model.proto.graph
    light = onnx.helper.make_graph([], graph.name or "g", [], list(graph.output))
    light.node.extend(graph.node)
    for spec in model.inputs:
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        light.input.append(onnx.helper.make_tensor_value_info(spec.name, elem, shapes[spec.name]))
    for init in graph.initializer:
        if np.prod(init.dims, dtype=np.int64) <= 64:
            light.initializer.append(init)
        else:
            light.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    m = onnx.helper.make_model(light, opset_imports=list(model.proto.opset_import))
    m.ir_version = model.proto.ir_version
    m.functions.extend(model.proto.functions)
    return onnx.shape_inference.infer_shapes(m, data_prop=True)


def _constant(proto: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in proto.graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return onnx.numpy_helper.to_array(a.t)
    return None


def _value(
    use: Use,
    shape: tuple[int, ...],
    dtype: np.dtype,
    known: Mapping[str, tuple],
    proto: onnx.ModelProto,
    rng: np.random.Generator,
) -> np.ndarray | None:
    """A value valid at ``use`` for an input of ``shape``, or None when the walk cannot tell."""
    data = known.get(use.inputs[0]) if use.inputs else None
    kind = use.kind
    if kind in ("index", "onehot_index"):
        if kind == "onehot_index":
            depth = _constant(proto, use.inputs[1]) if len(use.inputs) > 1 else None
            bound = int(np.asarray(depth).reshape(-1)[0]) if depth is not None else 8
        elif data is None or not data:
            return None
        else:
            bound = data[use.axis % len(data)]
        if bound <= 0:
            return None
        ids = rng.integers(0, bound, shape).astype(dtype)
        if ids.size >= 2:  # both ends of the range, where off-by-one and edge rows show
            ids.flat[0], ids.flat[-1] = 0, bound - 1
        return ids
    if kind == "index_nd":
        if data is None or not shape:
            return None
        out = np.empty(shape, dtype)
        for j in range(shape[-1]):
            if use.batch_dims + j >= len(data):
                return None
            out[..., j] = rng.integers(0, data[use.batch_dims + j], shape[:-1])
        return out
    if kind == "reshape":
        if data is None or len(shape) != 1:
            return None
        n = shape[0]
        if n == len(data):
            target = list(data)
        elif 0 < n < len(data):
            target = [*data[: n - 1], -1]
        else:
            target = [*data, *([1] * (n - len(data)))]
        return np.array(target, dtype).reshape(shape)
    if kind == "data_shape":
        return None if data is None or shape != (len(data),) else np.array(data, dtype)
    if kind == "axes":
        return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    if kind == "end":
        big = max(data) if data else 1 << 30
        return np.full(shape, big, dtype)
    fill = {"ones": 1, "one": 1, "zero": 0, "positive": 2, "nonzero": 1, "seq_len": 1}.get(kind)
    return None if fill is None else np.full(shape, fill, dtype)


def make_feeds(
    model: Model,
    shapes: Mapping[str, tuple[int, ...]],
    seed: int = 0,
    session: Any = None,
) -> dict[str, np.ndarray]:
    """Inputs of ``shapes`` the model accepts: random floats, 0/1 integers, and valid values
    for integer inputs that reach shape or index positions (module docstring).

    Args:
        model: the model the inputs are for.
        shapes: one concrete shape per input.
        seed: seed of the random values.
        session: an ONNX Runtime session on ``model``: when a value is a guess, candidates are
            tried on it until one runs.

    Raises:
        BuildError: no valid value found for an integer input; the message names the input
            and the node it reaches, and asks for ``verify_data=``.
    """
    feeds = random_feeds(model.inputs, shapes, seed)
    ints = [s.name for s in model.inputs if feeds[s.name].dtype.kind in "iu"]
    uses = find_uses(model.proto, ints) if ints else {}
    if not uses:
        return feeds
    known = _known_shapes(model, shapes)
    rng = np.random.default_rng(seed + 7919)
    guesses: dict[str, list[np.ndarray]] = {}
    for name, found in uses.items():
        shape, dtype = tuple(feeds[name].shape), feeds[name].dtype
        values = [_value(u, shape, dtype, known, model.proto, rng) for u in found]
        exact = [v for u, v in zip(found, values) if u.exact and v is not None]
        if exact and len(exact) == len(found):
            # Several index positions: the smallest bound holds for all of them.
            feeds[name] = min(exact, key=lambda v: int(v.max()) if v.size else 0)
            continue
        candidates = [v for v in [*exact, *values] if v is not None]
        for fill in (1, 0, 2, *sorted({d for s in known.values() for d in s if d > 2})[:4]):
            candidates.append(np.full(shape, fill, dtype))
        guesses[name] = _unique(candidates)
        feeds[name] = guesses[name][0]
    if guesses and session is not None:
        _search(model, feeds, guesses, uses, session)
    return feeds


def _unique(arrays: list[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for a in arrays:
        if not any(a.shape == b.shape and np.array_equal(a, b) for b in out):
            out.append(a)
    return out


def _search(
    model: Model,
    feeds: dict[str, np.ndarray],
    guesses: Mapping[str, list[np.ndarray]],
    uses: Mapping[str, list[Use]],
    session: Any,
    limit: int = 24,
) -> None:
    """Try combinations of the guessed values on the reference until one runs (in place)."""
    names = list(guesses)
    error = ""
    for combo in itertools.islice(itertools.product(*(guesses[n] for n in names)), limit):
        trial = {**feeds, **dict(zip(names, combo))}
        try:
            session.run(None, trial)
        except Exception as exc:  # the reference rejecting a guess is the signal to go on
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        feeds.update(trial)
        return
    where = "; ".join(u.describe() for n in names for u in uses[n])
    raise BuildError(
        f"cannot make valid verification inputs for {model_name(model)}: {where}, and no "
        f"value tried runs on ONNX Runtime ({error}). Pass verify_data= (arrays, a mapping, "
        "an .npz or a folder of .npy/.npz; CLI: --verify-data) with real inputs"
    )


def model_name(model: Model) -> str:
    """How messages name a model: its file, or its graph's name."""
    return model.label
