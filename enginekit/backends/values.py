"""Value inputs: graph inputs whose *values* decide shapes, found once for every backend.

Many ONNX models (and ONNX's own test cases) feed shape-like values as graph inputs: Reshape's
shape, Expand/Tile/ConstantOfShape sizes, Range limits, Resize sizes or scales, OneHot's depth,
TopK's k, Slice's starts and ends, If's condition. A backend that compiles static shapes (XLA)
or builds them into the program when importing (TVM's Relax importer) needs those values as
constants.

:func:`find` spots such inputs when the engine is built, given the backend's table of operands
it must know at compile time. The build then compiles a program with the example values bound
as constants (:func:`bind`, :func:`example_values`: the first verification point's values, so
verification runs the program the artifact holds), and the artifact keeps the ONNX model as
well (:func:`save_model`); at inference the engine reads those inputs on the host and compiles
a program specialized to each distinct set of values once (:class:`ProgramCache`, keyed by
:func:`key`). Backends: :mod:`enginekit.backends.xla.values`,
:mod:`enginekit.backends.tvm.values`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError
from enginekit.passes.nodes import node_label, subgraphs, topological, uses

if TYPE_CHECKING:
    from enginekit.model import Model

#: A value input may hold at most this many elements: it is read on the host and becomes part
#: of the program's cache key (a shape or an index list, not a tensor of data).
VALUE_LIMIT = 1024
#: Specialized programs an engine keeps (least recently used dropped first).
CACHE_SIZE = 16

#: op -> indices of the inputs a backend must know to compile the op.
Slots = Mapping[str, tuple[int, ...]]

#: The ONNX operands that decide an op's output shape, or its axes: what XLA (static shapes)
#: and TVM's importer (builds shapes and attributes from constants) both must know to compile.
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1, 3),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "TopK": (1,),
    "Trilu": (1,),
    "CumSum": (1,),
    "Dropout": (1, 2),
    "Resize": (1, 2, 3),
    "CumProd": (1,),
    "OneHot": (1,),
    "Upsample": (1,),
    "If": (0,),
    "Loop": (0, 1),
    "AffineGrid": (1,),
    "CenterCropPad": (1,),
    "Col2Im": (1, 2),
    "MaxUnpool": (2,),
    "Compress": (1,),
    "DFT": (1, 2),
    "STFT": (1, 3),
    "BlackmanWindow": (0,),
    "HammingWindow": (0,),
    "HannWindow": (0,),
    "MelWeightMatrix": (0, 1, 2, 3, 4),
    **{
        f"Reduce{kind}": (1,)
        for kind in (
            "L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum", "SumSquare"
        )
    },
}  # fmt: skip
Key = tuple[tuple[str, str, tuple[int, ...], bytes], ...]
T = TypeVar("T")


def find(proto: onnx.ModelProto, slots: Slots) -> dict[str, str]:
    """Graph inputs whose values reach an operand listed in ``slots``.

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
    _walk(proto.graph, slots, values, {}, found)
    return {n: found[n] for n in inputs if n in found}


def _walk(
    graph: onnx.GraphProto,
    slots: Slots,
    values: dict[str, frozenset[str]],
    shapes: dict[str, frozenset[str]],
    found: dict[str, str],
) -> None:
    """Propagate, per tensor, the inputs its values (``values``) and shape (``shapes``) depend
    on, in place; record in ``found`` each input reaching a compile-time operand."""
    empty: frozenset[str] = frozenset()
    for index, node in enumerate(topological(graph, frozenset(values) | frozenset(shapes))):
        read = [n for n in uses(node) if n]
        static = slots.get(node.op_type, ())
        for slot in static:
            if slot < len(node.input) and node.input[slot]:
                for name in sorted(values.get(node.input[slot], empty)):
                    found.setdefault(name, f"{node_label(node, index)} input {slot}")
        for branch in subgraphs(node):  # If/Loop bodies read the outer scope
            inner = dict(values)
            inner.update((t.name, frozenset()) for t in branch.initializer)
            _walk(branch, slots, inner, dict(shapes), found)
        if node.op_type in ("Shape", "Size"):
            out_values = shapes.get(node.input[0], empty) if node.input else empty
            out_shape = empty
        else:
            out_values = frozenset().union(
                *(values.get(n, empty) for n in read), *(shapes.get(n, empty) for n in read)
            )
            decided = [values.get(node.input[s], empty) for s in static if s < len(node.input)]
            out_shape = frozenset().union(*(shapes.get(n, empty) for n in read), *decided)
            if subgraphs(node):  # a branch's result may take any shape its reads allow
                out_shape = out_shape | out_values
        for name in node.output:
            if name:
                values[name] = out_values
                shapes[name] = out_shape


def check_sizes(
    found: Mapping[str, str],
    sizes: Mapping[str, int | None],
    label: str = "the model",
    backend: str = "XLA",
) -> None:
    """Refuse value inputs too large to read on the host and key programs by.

    Args:
        found: :func:`find`'s result.
        sizes: per input, the most elements the build's profiles allow (None: unbounded).
        backend: the backend's name, for the message.

    Raises:
        BuildError: naming the input, what it feeds and its size.
    """
    for name, where in found.items():
        size = sizes.get(name)
        if size is None or size > VALUE_LIMIT:
            held = "an unbounded number of" if size is None else f"up to {size}"
            raise BuildError(
                f"{label}: input {name!r} feeds {where}, a value the {backend} backend must know "
                f"to compile; enginekit compiles one program per distinct value of such inputs, "
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
    given: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """The value inputs' values in the build's first verification inputs, so verifying runs
    the program compiled at build: ``given`` (the first ``verify_data`` batch,
    :attr:`enginekit.config.BuildConfig.verify_example`) when it has them, otherwise the
    generated inputs' shapes, sizes and indices the model accepts
    (:func:`enginekit.feeds.make_feeds`)."""
    if given is not None and all(n in given for n in found):
        return {n: np.asarray(given[n]) for n in found}
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
    weights: str | None,
    model: str,
) -> dict[str, Any] | None:
    """``backend.metadata.value_inputs``: what each input feeds, the programs the artifact
    holds (by the values they were specialized to), the model file; None without value inputs."""
    if not found:
        return None
    entry: dict[str, Any] = {"values": to_json(example), "program": program}
    if weights is not None:
        entry["weights"] = weights
    return {
        "inputs": dict(found),
        "programs": [entry] if example else [],
        "model": model,
        "cache_size": CACHE_SIZE,
    }


def save_model(path: Path, proto: onnx.ModelProto) -> None:
    """Keep the ONNX model in the payload: new values compile from it at inference.

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
    """A thread-safe LRU of programs by :func:`key`.

    A miss compiles outside the lock, once per key: the first thread to miss a key registers a
    future for it, compiles, and publishes the program (or the error) to every thread that asked
    for that key meanwhile. Threads whose keys are cached, or that compile other keys, do not
    wait for it: a TVM compile takes seconds. A failed compile is not remembered (the next call
    compiles again). Keys being compiled are not in the LRU yet, so eviction never drops one
    from under its waiters; the program joins the LRU, as its most recent entry, when it is
    made.
    """

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._items: collections.OrderedDict[Key, T] = collections.OrderedDict()
        self._compiling: dict[Key, concurrent.futures.Future[T]] = {}
        self._lock = threading.Lock()
        self._cleared = False  # the engine closed: programs compiled from now on are not kept

    def get(self, k: Key, make: Callable[[], T]) -> T:
        """The program for ``k``, made by ``make()`` on a miss (evicting the oldest).

        Raises:
            Exception: what ``make()`` raised, in every thread waiting for ``k``.
        """
        with self._lock:
            found = self._items.get(k)
            if found is not None:
                self._items.move_to_end(k)
                return found
            pending = self._compiling.get(k)
            if pending is None:
                mine: concurrent.futures.Future[T] = concurrent.futures.Future()
                self._compiling[k] = mine
        if pending is not None:
            return self._wait(pending)
        try:
            made = make()
        except BaseException as exc:
            with self._lock:
                del self._compiling[k]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[k]
            if not self._cleared:  # after clear() the callers get it, the cache does not
                self._items[k] = made
                self._items.move_to_end(k)
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        mine.set_result(made)
        return made

    def _wait(self, pending: concurrent.futures.Future[T]) -> T:
        """The program another thread is compiling (a method so tests see a thread join it)."""
        return pending.result()

    def put(self, k: Key, program: T) -> None:
        """Seed the cache (the programs compiled at build)."""
        with self._lock:
            self._items[k] = program
            self._items.move_to_end(k)

    def __len__(self) -> int:
        """How many programs are held (those still compiling are not counted)."""
        with self._lock:
            return len(self._items)

    def items(self) -> list[tuple[Key, T]]:
        """(key, program) pairs, least recently used first (those still compiling are not
        listed)."""
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        """Drop every program, for good (the engine closes): one still compiling goes to the
        calls waiting for it and is not kept."""
        with self._lock:
            self._items.clear()
            self._cleared = True
