"""Value inputs on XLA: programs specialized to the values of inputs that decide shapes.

XLA compiles static shapes and ``jax.export`` cannot trace a value into a shape, so the
lowering needs shape-deciding values as constants. The backend-neutral part (which inputs are
value inputs, binding values as initializers, the program LRU, the manifest entry) is
:mod:`enginekit.backends.values`, re-exported here; this module adds XLA's table of operands
the lowering must know (:data:`~enginekit.backends.xla.ops.STATIC_INPUTS`) and the
:class:`Specializer` that lowers and exports a program for new values at inference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from enginekit.backends.values import (
    CACHE_SIZE,
    VALUE_LIMIT,
    Key,
    ProgramCache,
    bind,
    check_sizes,
    describe,
    example_values,
    from_json,
    key,
    max_sizes,
    metadata,
    save_model,
    to_json,
)
from enginekit.backends.values import find as _find
from enginekit.engine import TensorSpec

if TYPE_CHECKING:
    from enginekit.artifact import Artifact

__all__ = [
    "CACHE_SIZE",
    "VALUE_LIMIT",
    "Key",
    "ProgramCache",
    "Recipe",
    "Specializer",
    "bind",
    "check_sizes",
    "describe",
    "example_values",
    "find",
    "from_json",
    "key",
    "load_specializer",
    "max_sizes",
    "metadata",
    "save_model",
    "to_json",
]


def find(proto: onnx.ModelProto) -> dict[str, str]:
    """Graph inputs whose values reach an operand XLA's lowering must know at compile time
    (:func:`enginekit.backends.values.find` with XLA's table)."""
    from enginekit.backends.xla.ops import STATIC_INPUTS

    return _find(proto, STATIC_INPUTS)


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
        # Programs for different values compile at once (ProgramCache compiles outside its
        # lock): without this, two could each put the same weight on the device.
        self._sharing = threading.Lock()

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
            with self._sharing:
                found = self._shared.get(k)
                if found is None:
                    found = self._put(w)
                    self._shared[k] = found
            out.append(found)
        return out
