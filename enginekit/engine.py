"""Engine: the one runtime interface every backend returns.

The base class does the shared work once — input normalization and validation, splitting batches
larger than the built profiles, empty batches, async calls, closing — and calls ``_run``, the
small hook each backend fills in.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import ShapeProfile
from enginekit.errors import EngineInputError, EnginekitError

Dim = int | str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A named tensor: numpy dtype name and shape; symbolic dims are strings such as ``"batch"``."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(str(data["name"]), str(data["dtype"]), tuple(data["shape"]))

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        return f"{self.name}: {self.dtype}[{dims}]"


_UNCHECKED = object()
_CHECKED_MAX = 4096  # distinct (dtype, shape) signatures remembered per engine

Batch = Mapping[str, Any] | Sequence[Any] | np.ndarray | Any


def to_numpy(value: Any, name: str) -> np.ndarray:
    """Turn an array-like (numpy, DLPack producer, ``__array__``) into a numpy array, no casts."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass  # e.g. a device tensor or a read-only/conjugated view: fall back to __array__
    if hasattr(value, "__array__") or isinstance(value, (list, tuple, int, float, bool)):
        return np.asarray(value)
    raise EngineInputError(
        f"input {name!r}: expected an array (numpy, or anything with __dlpack__ or __array__), "
        f"got {type(value).__name__}"
    )


class Engine:
    """A built, loaded inference engine. Call :meth:`infer` with a batch of inputs.

    Attributes:
        inputs: input specs in the order a sequence batch is read.
        outputs: output specs in the order ``infer`` returns them.
        profiles: the optimization profiles the engine was built for (empty: any size).
        manifest: the artifact manifest this engine was loaded from (empty if none).
        artifact: the artifact it was loaded or built from (for tools that reopen its payload,
            such as ``enginekit profile``); None for an engine made another way.
        load_options: what ``ek.load`` set instead of the build options (``threads``,
            ``spinning``); empty when loaded as built.
    """

    # An enginekit.artifact.Artifact; typed Any because artifact.py sits beside this module and
    # imports model.py, which imports this one (no cycle, not even a type-only one).
    artifact: Any = None
    load_options: Mapping[str, Any] = types.MappingProxyType({})

    def __init__(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        profiles: Sequence[Mapping[str, ShapeProfile]] = (),
        manifest: Mapping[str, Any] | None = None,
    ) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.profiles = tuple(dict(p) for p in profiles)
        self.manifest: dict[str, Any] = dict(manifest or {})
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._names = tuple(s.name for s in self.inputs)
        self._checked: dict[tuple[Any, ...], Any] = {}
        self._single = self._names[0] if len(self._names) == 1 else None
        # Per-input check plan, computed once so that infer() does only comparisons.
        self._plan = tuple(
            (
                s.name,
                np.dtype(s.dtype),
                len(s.shape),
                tuple((axis, d) for axis, d in enumerate(s.shape) if isinstance(d, int)),
            )
            for s in self.inputs
        )
        shared: dict[str, list[tuple[str, int]]] = {}
        for s in self.inputs:
            for axis, d in enumerate(s.shape):
                if isinstance(d, str) and d != "?":
                    shared.setdefault(d, []).append((s.name, axis))
        self._shared_dims = tuple(
            (sym, tuple(uses)) for sym, uses in shared.items() if len(uses) > 1
        )
        first = [s.shape[0] if s.shape else None for s in self.inputs]
        self._batched = (
            bool(first) and isinstance(first[0], str) and all(d == first[0] for d in first)
        )
        self._outputs_batched = self._batched and all(
            o.shape and o.shape[0] == first[0] for o in self.outputs
        )
        self._max_batch = (
            max(min(p[n].max[0] for n in self._names) for p in self.profiles)
            if self._batched
            and self.profiles
            and all(n in p for p in self.profiles for n in self._names)
            else None
        )
        # The smallest batch any profile accepts: smaller chunks are padded up to it.
        self._min_batch = (
            min(min(p[n].min[0] for n in self._names if n in p) for p in self.profiles)
            if self._batched and self.profiles
            else 0
        )

    # -- public API --------------------------------------------------------------------------

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        """Run the engine on one batch.

        Args:
            batch: a mapping input name -> array, a sequence of arrays in input order, or one
                array for a single-input model. Arrays from torch, jax or cupy are accepted
                through DLPack / ``__array__``; dtypes must match exactly (no silent casts).

        Returns:
            output name -> numpy array, in output order. A batch with 0 rows returns outputs
            with 0 rows; a batch larger than the largest built profile is split and re-joined.

        Raises:
            EngineInputError: a wrong, missing or extra name, dtype, rank or dim.
        """
        if self._closed:
            raise EnginekitError("infer() on a closed engine; load it again")
        # Validation depends only on dtypes and shapes: remember the signatures that passed.
        # The common single-input calls skip building an intermediate dict and key tuple.
        single = self._single
        if single is not None and type(batch) is np.ndarray:
            feeds = {single: batch}
            key: Any = (batch.dtype, batch.shape)
        elif single is not None and type(batch) is dict and len(batch) == 1:
            a = batch.get(single)
            if type(a) is np.ndarray:
                feeds, key = batch, (a.dtype, a.shape)
            else:
                feeds = self._feeds(batch)
                key = (feeds[single].dtype, feeds[single].shape)
        else:
            feeds = self._feeds(batch)
            key = tuple([(a.dtype, a.shape) for a in feeds.values()])
        rows = self._checked.get(key, _UNCHECKED)
        if rows is _UNCHECKED:
            rows = self._check(feeds)
            if len(self._checked) < _CHECKED_MAX:
                self._checked[key] = rows
        if rows is None:
            return self._run(feeds)
        return self._run_rows(feeds, rows)

    def infer_async(self, batch: Batch) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Run :meth:`infer` on a worker thread; returns a Future of its result."""
        if self._closed:
            raise EnginekitError("infer_async() on a closed engine; load it again")
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="enginekit"
                )
        return self._executor.submit(self.infer, batch)

    def close(self) -> None:
        """Release the backend's resources; the engine cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        backend = self.manifest.get("backend", {}).get("name", type(self).__name__)
        ins = ", ".join(str(s) for s in self.inputs)
        outs = ", ".join(str(s) for s in self.outputs)
        return f"<Engine {backend} ({ins}) -> ({outs})>"

    # -- hooks for backends ------------------------------------------------------------------

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run validated feeds whose shapes fit a built profile. Must be thread-safe."""
        raise NotImplementedError

    def _close(self) -> None:
        """Free backend resources (called once)."""

    # -- validation ----------------------------------------------------------------------------

    def _feeds(self, batch: Batch) -> dict[str, np.ndarray]:
        names = self._names
        if type(batch) is np.ndarray and len(names) == 1:
            return {names[0]: batch}
        if type(batch) is dict and len(batch) == len(names):
            try:
                feeds = {n: batch[n] for n in names}
            except KeyError:
                self._name_error(batch)
            for n, v in feeds.items():
                if type(v) is not np.ndarray:
                    feeds[n] = to_numpy(v, n)
            return feeds
        if isinstance(batch, Mapping):
            if len(batch) != len(names) or any(n not in batch for n in names):
                self._name_error(batch)
            return {
                n: v if type(v) is np.ndarray else to_numpy(v, n)
                for n, v in ((n, batch[n]) for n in names)
            }
        if isinstance(batch, (list, tuple)):
            if len(batch) != len(names):
                raise EngineInputError(
                    f"expected {len(names)} inputs in order ({', '.join(names)}), "
                    f"got a sequence of {len(batch)}"
                )
            return {n: v if type(v) is np.ndarray else to_numpy(v, n) for n, v in zip(names, batch)}
        if len(names) != 1:
            raise EngineInputError(
                f"this engine has {len(names)} inputs ({', '.join(names)}); pass a dict "
                "name -> array or a sequence in that order, not a single array"
            )
        return {names[0]: to_numpy(batch, names[0])}

    def _name_error(self, batch: Mapping[str, Any]) -> None:
        given = [str(k) for k in batch]
        missing = [n for n in self._names if n not in batch]
        extra = [k for k in given if k not in self._names]
        parts = []
        if missing:
            parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unknown input(s) {', '.join(map(repr, extra))}")
        raise EngineInputError(
            "; ".join(parts) + f" — this engine takes {', '.join(map(repr, self._names))}"
        )

    def _check(self, feeds: dict[str, np.ndarray]) -> int | None:
        """Validate feeds; return the row count when the batch must be split or is empty."""
        for name, dtype, ndim, fixed in self._plan:
            a = feeds[name]
            if a.dtype != dtype:
                raise EngineInputError(
                    f"input {name!r}: expected dtype {dtype}, got {a.dtype} "
                    f"(cast it yourself, e.g. x.astype(np.{dtype}); enginekit never casts silently)"
                )
            if a.ndim != ndim:
                spec = self._spec(name)
                raise EngineInputError(
                    f"input {name!r}: expected rank {ndim} {spec.shape}, got rank {a.ndim} "
                    f"with shape {a.shape}"
                )
            shape = a.shape
            for axis, size in fixed:
                if shape[axis] != size:
                    raise EngineInputError(
                        f"input {name!r}: dim {axis} must be {size} (spec "
                        f"{self._spec(name).shape}), got shape {shape}"
                    )
        for sym, uses in self._shared_dims:
            sizes = {feeds[n].shape[axis] for n, axis in uses}
            if len(sizes) > 1:
                given = ", ".join(f"{n}[{axis}]={feeds[n].shape[axis]}" for n, axis in uses)
                raise EngineInputError(f"inputs share dim {sym!r} but differ: {given}")
        rows = feeds[self._names[0]].shape[0] if self._batched else None
        if rows == 0:
            if not self._outputs_batched:
                raise EngineInputError(
                    "empty batch (0 rows): this engine's outputs have no batch dim to return "
                    "empty outputs along"
                )
            return 0
        if not self.profiles:
            return None
        for p in self.profiles:
            if all(p[n].contains(feeds[n].shape) for n in self._names if n in p):
                return None
        if self._max_batch is not None and rows is not None:
            outside = rows > self._max_batch or rows < self._min_batch
            if outside and self._outputs_batched and self._fits_some_profile_ignoring_batch(feeds):
                return rows  # split into chunks of the largest batch; a small one is padded
        self._profile_error(feeds)
        return None  # unreachable: _profile_error raises

    def _fits_some_profile_ignoring_batch(self, feeds: dict[str, np.ndarray]) -> bool:
        return any(
            all(p[n].contains((p[n].max[0],) + feeds[n].shape[1:]) for n in self._names if n in p)
            for p in self.profiles
        )

    def _profile_error(self, feeds: dict[str, np.ndarray]) -> None:
        ranges = []
        for i, p in enumerate(self.profiles):
            for n in self._names:
                if n not in p:
                    continue
                shape = feeds[n].shape
                for axis, (d, lo, hi) in enumerate(zip(shape, p[n].min, p[n].max)):
                    if not lo <= d <= hi:
                        ranges.append(f"profile {i}: {n!r} dim {axis} is {d}, built for {lo}..{hi}")
        raise EngineInputError(
            "input shapes fit no built profile: "
            + "; ".join(ranges)
            + " — rebuild with wider --shapes to accept them"
        )

    def _spec(self, name: str) -> TensorSpec:
        return next(s for s in self.inputs if s.name == name)

    # -- empty and oversized batches -----------------------------------------------------------

    def _run_rows(self, feeds: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        if rows == 0:
            # Run one zero row to learn the output shapes and dtypes, then return 0 rows of each.
            one = {n: np.zeros((1,) + a.shape[1:], a.dtype) for n, a in feeds.items()}
            return {k: v[:0] for k, v in self._run_chunk(one, 1).items()}
        step = self._max_batch
        assert step is not None  # _check returns rows > 0 only when _max_batch is known
        parts = [
            self._run_chunk(
                {n: a[start : start + step] for n, a in feeds.items()}, min(step, rows - start)
            )
            for start in range(0, rows, step)
        ]
        return {o.name: np.concatenate([p[o.name] for p in parts]) for o in self.outputs}

    def _run_chunk(self, feeds: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """Run ``rows`` rows, padding up to the smallest batch a profile accepts."""
        missing = self._min_batch - rows
        if missing <= 0:
            return self._run(feeds)
        padded = {}
        for n, a in feeds.items():
            filler = a[-1:] if len(a) else np.zeros((1, *a.shape[1:]), a.dtype)
            padded[n] = np.concatenate([a, np.repeat(filler, missing, axis=0)])
        return {k: v[:rows] for k, v in self._run(padded).items()}
