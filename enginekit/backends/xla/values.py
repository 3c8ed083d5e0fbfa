"""Value inputs: graph inputs whose *values* decide shapes, and programs specialized to them.

Many ONNX models (and ONNX's own test cases) feed shape-like values as graph inputs: Reshape's
shape, Expand/Tile/ConstantOfShape sizes, Range limits, Resize sizes or scales, OneHot's depth,
TopK's k, Slice's starts and ends, If's condition. XLA compiles static shapes and ``jax.export``
cannot trace a value into a shape, so the lowering needs those values as constants.

:func:`find` spots such inputs when the engine is built (an input whose values reach an operand
the lowering must know, :data:`~enginekit.backends.xla.ops.STATIC_INPUTS`). The build then lowers
a program with the example values bound as constants (:func:`bind`), and the artifact keeps the
ONNX model as well; at inference the engine reads those inputs on the host and compiles (once per
distinct set of values, :class:`ProgramCache`) a program specialized to them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.backends.xla.nodes import node_label, subgraphs
from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.model import Model

#: A value input may hold at most this many elements: it is read on the host and becomes part
#: of the program's cache key (a shape or an index list, not a tensor of data).
VALUE_LIMIT = 1024
#: Specialized programs an engine keeps (least recently used dropped first).
CACHE_SIZE = 16

Key = tuple[tuple[str, str, tuple[int, ...], bytes], ...]
T = TypeVar("T")


def _static_slots(op: str) -> tuple[int, ...]:
    from enginekit.backends.xla.ops import STATIC_INPUTS

    return STATIC_INPUTS.get(op, ())


def find(proto: onnx.ModelProto) -> dict[str, str]:
    """Graph inputs whose values reach an operand the lowering must know at compile time.

    Returns:
        input name -> where it first arrives (``"Reshape 'r' input 1"``), in graph input order.

    Values are followed through every op; a Shape (or Size) hands on the *shape*
    dependence of its operand, not its values, so an embedding's ids that end up in a
    ``Reshape(x, Shape(x))`` are not value inputs, while ``Shape(Range(0, n))`` depends on ``n``.
    """
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    values = {n: frozenset() for n in initializers} | {n: frozenset({n}) for n in inputs}
    found: dict[str, str] = {}
    _walk(proto.graph, values, {}, found)
    return {n: found[n] for n in inputs if n in found}


def _walk(
    graph: onnx.GraphProto,
    values: dict[str, frozenset[str]],
    shapes: dict[str, frozenset[str]],
    found: dict[str, str],
) -> None:
    """Propagate, per tensor, the inputs its values (``values``) and shape (``shapes``) depend
    on, in place; record in ``found`` each input reaching a compile-time operand."""
    from enginekit.backends.xla.nodes import topological, uses

    empty: frozenset[str] = frozenset()
    for index, node in enumerate(topological(graph, frozenset(values) | frozenset(shapes))):
        read = [n for n in uses(node) if n]
        for slot in _static_slots(node.op_type):
            if slot < len(node.input) and node.input[slot]:
                for name in sorted(values.get(node.input[slot], empty)):
                    found.setdefault(name, f"{node_label(node, index)} input {slot}")
        for branch in subgraphs(node):  # If/Loop bodies read the outer scope
            inner = dict(values)
            inner.update((t.name, frozenset()) for t in branch.initializer)
            _walk(branch, inner, dict(shapes), found)
        if node.op_type in ("Shape", "Size"):
            out_values = shapes.get(node.input[0], empty) if node.input else empty
            out_shape = empty
        else:
            out_values = frozenset().union(
                *(values.get(n, empty) for n in read), *(shapes.get(n, empty) for n in read)
            )
            decided = [
                values.get(node.input[s], empty)
                for s in _static_slots(node.op_type)
                if s < len(node.input)
            ]
            out_shape = frozenset().union(*(shapes.get(n, empty) for n in read), *decided)
            if subgraphs(node):  # a branch's result may take any shape its reads allow
                out_shape = out_shape | out_values
        for name in node.output:
            if name:
                values[name] = out_values
                shapes[name] = out_shape


def check_sizes(
    found: Mapping[str, str], sizes: Mapping[str, int | None], label: str = "the model"
) -> None:
    """Refuse value inputs too large to read on the host and key programs by.

    Args:
        found: :func:`find`'s result.
        sizes: per input, the most elements the build's profiles allow (None: unbounded).

    Raises:
        BuildError: naming the input, what it feeds and its size.
    """
    for name, where in found.items():
        size = sizes.get(name)
        if size is None or size > VALUE_LIMIT:
            held = "an unbounded number of" if size is None else f"up to {size}"
            raise BuildError(
                f"{label}: input {name!r} feeds {where}, a value the XLA backend must know to "
                f"compile; enginekit compiles one program per distinct value of such inputs, "
                f"but {name!r} holds {held} elements (at most {VALUE_LIMIT}). Fix its shape "
                "with shapes=, or build with --backend onnxruntime"
            )


def max_sizes(
    specs: Sequence[TensorSpec], profiles: Sequence[Mapping[str, ShapeProfile]]
) -> dict[str, int | None]:
    """Per input, the most elements it may hold under the profiles (None: unbounded)."""
    out: dict[str, int | None] = {}
    for spec in specs:
        fixed = [d for d in spec.shape if isinstance(d, int)]
        if len(fixed) == len(spec.shape):
            out[spec.name] = math.prod(fixed)
            continue
        tops = [math.prod(p[spec.name].max) for p in profiles if spec.name in p]
        out[spec.name] = max(tops) if tops else None
    return out


def example_values(
    model: Model,
    profiles: Sequence[Mapping[str, ShapeProfile]],
    seed: int,
    found: Mapping[str, str],
) -> dict[str, np.ndarray]:
    """The value inputs' values in the build's first verification inputs, so verifying runs
    the program compiled at build: shapes, sizes and indices the model accepts
    (:func:`enginekit.feeds.make_feeds`)."""
    from enginekit.feeds import make_feeds
    from enginekit.model import reference_session
    from enginekit.verify import verification_points

    shapes = verification_points(model, profiles)[0]
    try:
        feeds = make_feeds(model, shapes, seed=seed, session=reference_session(model))
    except BuildError:  # no generated value runs: verification asks for verify_data=
        feeds = make_feeds(model, shapes, seed=seed)
    return {n: feeds[n] for n in found}


def metadata(
    found: Mapping[str, str],
    example: Mapping[str, np.ndarray],
    program: str,
    weights: str,
    model: str,
) -> dict[str, Any] | None:
    """``backend.metadata.value_inputs``: what each input feeds, the programs the artifact
    holds (by the values they were specialized to), the model file; None without value inputs."""
    if not found:
        return None
    programs = [{"values": to_json(example), "program": program, "weights": weights}]
    return {
        "inputs": dict(found),
        "programs": programs if example else [],
        "model": model,
        "cache_size": CACHE_SIZE,
    }


def save_model(path: Path, proto: onnx.ModelProto) -> None:
    """Keep the ONNX model in the payload: new values lower from it at inference.

    Raises:
        BuildError: the model is past protobuf's 2 GB.
    """
    try:
        path.write_bytes(proto.SerializeToString())
    except ValueError as exc:
        raise BuildError(
            f"the model cannot be kept for value-specialized programs ({exc}); its value "
            "inputs need it at inference. Make those inputs constants, or build with "
            "--backend onnxruntime"
        ) from None


def load_specializer(
    artifact: Artifact, meta: Mapping[str, Any], put: Callable[[Any], Any]
) -> tuple[Specializer | None, dict[str, np.ndarray] | None]:
    """For an artifact with value inputs: what lowers a program for new values, and the values
    its stored program was specialized to (None without one); (None, None) otherwise."""
    from enginekit.backends.xla import program
    from enginekit.config import BuildConfig

    spec = meta.get("value_inputs")
    if not spec:
        return None, None
    found = dict(spec["inputs"])
    config = BuildConfig.from_json(artifact.manifest["config"])
    all_specs = [TensorSpec.from_json(i) for i in artifact.manifest["inputs"]]
    specs = [s for s in all_specs if s.name not in found]
    dims = program.symbolic_dims(specs, config.profiles)
    recipe = Recipe(
        layout=meta["layout"],
        precision=config.precision.value,
        dims=dims,
        bounds=program.symbol_bounds(specs, config.profiles, dims),
        platform=meta.get("platform", "cpu"),
    )
    names = [s.name for s in all_specs if s.name in found]
    specializer = Specializer(artifact.read(spec["model"]), names, recipe, put)
    stored = spec["programs"]
    return specializer, from_json(stored[0]["values"]) if stored else None


def bind(proto: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``proto`` with the value inputs turned into initializers holding ``values``."""
    bound = onnx.ModelProto()
    bound.CopyFrom(proto)
    kept = [i for i in bound.graph.input if i.name not in values]
    del bound.graph.input[:]
    bound.graph.input.extend(kept)
    bound.graph.initializer.extend(
        numpy_helper.from_array(np.asarray(v), name) for name, v in values.items()
    )
    return bound


def key(values: Mapping[str, np.ndarray]) -> Key:
    """A hashable identity of a set of values: name, dtype, shape and bytes of each."""
    out = []
    for name in sorted(values):
        a = np.ascontiguousarray(values[name])
        out.append((name, a.dtype.str, tuple(int(d) for d in a.shape), a.tobytes()))
    return tuple(out)


def to_json(values: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Values as the manifest records them (dtype, shape, flat list)."""
    return {
        name: {"dtype": np.asarray(v).dtype.name, "shape": list(np.shape(v)), "data": _flat(v)}
        for name, v in values.items()
    }


def _flat(value: np.ndarray) -> list[Any]:
    return [x.item() for x in np.asarray(value).reshape(-1)]


def from_json(data: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Inverse of :func:`to_json`."""
    return {
        name: np.asarray(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
        for name, v in data.items()
    }


def describe(values: Mapping[str, np.ndarray]) -> str:
    """``shape=[3, 4]``: how programs and errors name a set of values."""
    return ", ".join(f"{n}={_flat(v)}" for n, v in sorted(values.items()))


class ProgramCache(Generic[T]):
    """A thread-safe LRU of programs by :func:`key`; a miss compiles once, under the lock, so
    two threads asking for the same new values never compile it twice."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._items: collections.OrderedDict[Key, T] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, k: Key, make: Callable[[], T]) -> T:
        """The program for ``k``, made by ``make()`` on a miss (evicting the oldest)."""
        with self._lock:
            found = self._items.get(k)
            if found is not None:
                self._items.move_to_end(k)
                return found
            made = make()
            self._items[k] = made
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return made

    def put(self, k: Key, program: T) -> None:
        """Seed the cache (the programs compiled at build)."""
        with self._lock:
            self._items[k] = program
            self._items.move_to_end(k)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def items(self) -> list[tuple[Key, T]]:
        """(key, program) pairs, least recently used first."""
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to lower a specialized program the way the build lowered its own.

    Attributes:
        layout, precision: as the build chose (manifest ``backend.metadata``).
        dims: per program input (value inputs excluded), its dims as ints or symbol names.
        bounds: symbol -> [min, max] from the profiles (jax.export constraints).
        platform: ``cpu`` or ``cuda``.
    """

    layout: str
    precision: str
    dims: Mapping[str, Sequence[int | str]]
    bounds: Mapping[str, Sequence[int]]
    platform: str


class Specializer:
    """Lowers and exports the model for one set of values of the value inputs ``names``;
    weights equal across specializations are put on the device once and shared."""

    def __init__(
        self,
        model_bytes: bytes,
        names: Sequence[str],
        recipe: Recipe,
        put: Callable[[Any], Any],
    ) -> None:
        self.names = tuple(names)
        self._bytes = model_bytes
        self._proto: onnx.ModelProto | None = None
        self.recipe = recipe
        self._put = put
        # Weak: a weight goes when the last program holding it leaves the cache.
        self._shared: weakref.WeakValueDictionary[Any, Any] = weakref.WeakValueDictionary()

    def proto(self) -> onnx.ModelProto:
        """The ONNX model, parsed on first use."""
        if self._proto is None:
            self._proto = onnx.load_from_string(self._bytes)
        return self._proto

    def __call__(self, values: Mapping[str, np.ndarray], specs: Sequence[Any]) -> tuple[Any, list]:
        """(the exported program, its weights on the device) for these values.

        Raises:
            BuildError: the values do not lower (a shape the data cannot take, ...).
        """
        from enginekit.backends.xla import lower, program

        r = self.recipe
        lowered = lower.lower(bind(self.proto(), values), r.layout, precision=r.precision)
        exported = program.export(
            lowered.fn, lowered.weights, specs, r.dims, r.platform, r.bounds or None
        )
        return exported, self.share(lowered.weight_names, lowered.weights)

    def share(self, names: Sequence[str], weights: Sequence[np.ndarray]) -> list[Any]:
        """Weights on the device, reusing those an earlier program put there."""
        out = []
        for name, w in zip(names, weights):
            k = (name, w.dtype.str, tuple(w.shape), hashlib.sha1(w.tobytes()).hexdigest())
            found = self._shared.get(k)
            if found is None:
                found = self._put(w)
                self._shared[k] = found
            out.append(found)
        return out
