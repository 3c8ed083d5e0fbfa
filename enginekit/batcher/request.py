"""One request and how its sample maps onto the engine: validate, group, stack, split.

A sample is one row (each input without the batch dim) or a small batch (with it). It is checked
against the engine's input specs and profiles at submit, so that a bad request fails alone and
never reaches a batch. Requests whose non-batch dims differ (sequence length) get different group
keys and are batched separately — or, with padding on, grouped by the bucket their length pads to.
"""

from __future__ import annotations

import difflib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.batcher.slot import Slot
from enginekit.engine import Engine, to_numpy
from enginekit.errors import BatcherError, DeadlineExceeded, EngineInputError, UsageError

QUEUED, TAKEN, DEAD = 0, 1, 2

Key = tuple[Any, ...]
# What validation found, cached per input signature: single row?, rows, group key, lengths.
Form = tuple[bool, int, Key, "dict[str, int] | None"]


class Request:
    """A sample waiting for, or running in, a batch; ``future`` receives its outputs."""

    __slots__ = (
        "arrival",
        "deadline",
        "feeds",
        "future",
        "key",
        "lengths",
        "priority",
        "rows",
        "seq",
        "single",
        "state",
    )

    def __init__(
        self,
        feeds: dict[str, np.ndarray],
        form: Form,
        priority: int = 0,
        arrival: float = 0.0,
        deadline: float = math.inf,
    ) -> None:
        self.feeds = feeds
        # lengths: padded symbol -> this request's own size (padding only)
        self.single, self.rows, self.key, self.lengths = form
        self.future = Slot()
        self.priority = priority
        self.seq = 0
        self.arrival = arrival
        self.deadline = deadline
        self.state = QUEUED


def fail_expired(expired: Sequence[Request], batcher: str) -> None:
    """Fail requests that were dropped from the queue at their deadline (outside the lock)."""
    now = time.monotonic()
    for r in expired:
        if r.future.set_running_or_notify_cancel():
            r.future.set_exception(
                DeadlineExceeded(
                    f"batcher {batcher!r}: request waited {(now - r.arrival) * 1e3:.1f} ms in "
                    f"the queue, past its {(r.deadline - r.arrival) * 1e3:g} ms deadline; the "
                    "engine is overloaded — add capacity, lower the load, or allow a longer "
                    "timeout_ms"
                )
            )


def _closest(name: str, names: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names``, case-insensitively; or ''."""
    lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def _buckets_for(limit: int, low: int) -> tuple[int, ...]:
    """Powers of two from ``low`` up, capped by (and always including) ``limit``."""
    sizes, size = [], 1
    while size < limit:
        if size >= low:
            sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)


class Layout:
    """The engine's inputs and outputs as the batcher sees them; checks and reshapes requests."""

    def __init__(
        self,
        engine: Engine,
        pad_values: Mapping[str, float] | None = None,
        seq_buckets: Sequence[int] | None = None,
    ) -> None:
        self.names = tuple(s.name for s in engine.inputs)
        first = [s.shape[0] if s.shape else None for s in engine.inputs]
        batch = first[0] if first else None
        outs_ok = all(o.shape and o.shape[0] == batch for o in engine.outputs)
        if not isinstance(batch, str) or any(d != batch for d in first) or not outs_ok:
            raise UsageError(
                f"a Batcher needs an engine whose inputs and outputs all start with one symbolic "
                f"batch dim; this one has inputs {[str(s) for s in engine.inputs]} and outputs "
                f"{[str(s) for s in engine.outputs]} — export with dynamic_batch=True"
            )
        self.profiles = engine.profiles
        self._specs = {s.name: s for s in engine.inputs}
        self._dtypes = {s.name: np.dtype(s.dtype) for s in engine.inputs}
        self._rank = {s.name: len(s.shape) for s in engine.inputs}
        self._fixed = {
            s.name: tuple((a, d) for a, d in enumerate(s.shape) if a and isinstance(d, int))
            for s in engine.inputs
        }
        symbols: dict[str, list[tuple[str, int]]] = {}
        for s in engine.inputs:
            for axis, d in enumerate(s.shape[1:], 1):
                if isinstance(d, str) and d != "?":
                    symbols.setdefault(d, []).append((s.name, axis))
        self._shared = {sym: uses for sym, uses in symbols.items() if len(uses) > 1}
        self._checked: dict[Any, Form] = {}
        self.pad_values = dict(pad_values or {})
        self._padded: dict[str, tuple[str, int]] = {}  # symbol -> (input, axis) it is read from
        self._buckets: dict[str, tuple[int, ...]] = {}
        self._out_trim: dict[str, tuple[tuple[int, str], ...]] = {}
        if self.pad_values:
            self._setup_padding(engine, symbols, seq_buckets)

    def _setup_padding(
        self,
        engine: Engine,
        symbols: Mapping[str, list[tuple[str, int]]],
        seq_buckets: Sequence[int] | None,
    ) -> None:
        for name in self.pad_values:
            if name not in self._specs:
                raise UsageError(
                    f"pad_values names input {name!r}{_closest(name, self.names)}; the engine's inputs are "
                    f"{', '.join(map(repr, self.names))}"
                )
        for sym, uses in symbols.items():
            padded = [n for n, _ in uses if n in self.pad_values]
            if not padded:
                continue
            unpadded = [n for n, _ in uses if n not in self.pad_values]
            if unpadded:
                raise UsageError(
                    f"padding dim {sym!r}: inputs {', '.join(map(repr, unpadded))} share it "
                    f"but have no pad value; add them to pad_values (e.g. a mask pads with 0)"
                )
            name, axis = uses[0]
            limit = max((p[name].max[axis] for p in self.profiles if name in p), default=0)
            low = min((p[name].min[axis] for p in self.profiles if name in p), default=1)
            if seq_buckets is not None:
                sizes = tuple(sorted({int(b) for b in seq_buckets}))
                if limit and sizes[-1] < limit:
                    sizes = (*sizes, limit)
            elif limit:
                sizes = _buckets_for(limit, low)
            else:
                raise UsageError(
                    f"padding dim {sym!r}: the engine has no profile bounding it; "
                    "pass seq_buckets=(...) with the lengths to pad up to"
                )
            self._padded[sym] = (name, axis)
            self._buckets[sym] = sizes
        if not self._padded:
            raise UsageError(
                f"pad_values {sorted(self.pad_values)}: none of these inputs has a symbolic "
                "non-batch dim (such as a sequence length) to pad"
            )
        for o in engine.outputs:
            self._out_trim[o.name] = tuple(
                (axis, d) for axis, d in enumerate(o.shape[1:], 1) if d in self._padded
            )

    # -- at submit -----------------------------------------------------------------------------

    def prepare(self, sample: Any) -> tuple[dict[str, np.ndarray], Form]:
        """Normalize and validate ``sample``: its feeds (with the batch dim) and its form.
        Raises EngineInputError naming what is wrong."""
        names = self.names
        # Validation depends only on dtypes and shapes: the common forms look theirs up first.
        if type(sample) is np.ndarray and len(names) == 1:
            form = self._checked.get((sample.dtype, sample.shape))
            if form is not None:
                return {names[0]: sample[None] if form[0] else sample}, form
        elif type(sample) is dict and len(sample) == len(names) > 1:
            known = self._known_dict(sample)
            if known is not None:
                return known
        feeds = self._feeds(sample)
        sig: Any = tuple([(a.dtype, a.shape) for a in feeds.values()])
        if len(names) == 1:
            sig = sig[0]
        form = self._checked.get(sig)
        if form is None:
            form = self._check(feeds)
            if len(self._checked) < 4096:
                self._checked[sig] = form
        if form[0]:
            feeds = {n: a[None] for n, a in feeds.items()}
        return feeds, form

    def _known_dict(self, sample: dict[str, Any]) -> tuple[dict[str, np.ndarray], Form] | None:
        """A dict of numpy arrays whose signature passed before, ready; otherwise None."""
        arrays: list[np.ndarray] = []
        for n in self.names:
            a = sample.get(n)
            if type(a) is not np.ndarray:
                return None
            arrays.append(a)
        form = self._checked.get(tuple([(a.dtype, a.shape) for a in arrays]))
        if form is None:
            return None
        if form[0]:
            return {n: a[None] for n, a in zip(self.names, arrays)}, form
        return dict(zip(self.names, arrays)), form

    def _feeds(self, sample: Any) -> dict[str, np.ndarray]:
        """Any accepted form of a sample as name -> numpy array, in input order."""
        names = self.names
        if isinstance(sample, Mapping):
            if len(sample) != len(names) or any(n not in sample for n in names):
                self._name_error(sample)
            return {n: to_numpy(sample[n], n) for n in names}
        if len(names) == 1:
            return {names[0]: to_numpy(sample, names[0])}
        if isinstance(sample, (list, tuple)) and len(sample) == len(names):
            return {n: to_numpy(v, n) for n, v in zip(names, sample)}
        raise EngineInputError(
            f"this engine has {len(names)} inputs ({', '.join(names)}); submit a dict "
            "name -> array or a sequence in that order"
        )

    def _name_error(self, sample: Mapping[str, Any]) -> None:
        given = [str(k) for k in sample]
        parts = [f"missing input {n!r}" for n in self.names if n not in sample]
        for k in given:
            if k not in self.names:
                parts.append(f"unknown input {k!r}{_closest(k, self.names)}")
        raise EngineInputError(
            "; ".join(parts) + f" — this engine takes {', '.join(map(repr, self.names))}"
        )

    def _check(self, feeds: dict[str, np.ndarray]) -> Form:
        modes = set()
        for name, a in feeds.items():
            spec, rank = self._specs[name], self._rank[name]
            if a.dtype != self._dtypes[name]:
                raise EngineInputError(
                    f"input {name!r}: expected dtype {spec.dtype}, got {a.dtype} (cast it "
                    f"yourself, e.g. x.astype(np.{spec.dtype}); enginekit never casts silently)"
                )
            if a.ndim == rank - 1:
                modes.add("row")
            elif a.ndim == rank:
                modes.add("batch")
            else:
                raise EngineInputError(
                    f"input {name!r}: expected one row of rank {rank - 1} (shape "
                    f"{spec.shape[1:]}) or a batch of rank {rank} (shape {spec.shape}), got "
                    f"shape {a.shape}"
                )
        if len(modes) > 1:
            raise EngineInputError(
                "some inputs are single rows and some are batches: give every input its batch "
                "dim, or none of them"
            )
        single = modes == {"row"}
        shapes = {n: ((1,) if single else ()) + a.shape for n, a in feeds.items()}
        rows_seen = {s[0] for s in shapes.values()}
        if len(rows_seen) > 1:
            given = ", ".join(f"{n}: {s[0]}" for n, s in shapes.items())
            raise EngineInputError(f"inputs have different row counts ({given}); they must agree")
        rows = rows_seen.pop()
        if rows == 0:
            raise EngineInputError("a request with 0 rows: submit at least one row")
        for name, shape in shapes.items():
            for axis, size in self._fixed[name]:
                if shape[axis] != size:
                    raise EngineInputError(
                        f"input {name!r}: dim {axis} must be {size} (spec "
                        f"{self._specs[name].shape}), got {'row' if single else 'batch'} shape "
                        f"{feeds[name].shape}"
                    )
        for sym, uses in self._shared.items():
            sizes = {shapes[n][axis] for n, axis in uses}
            if len(sizes) > 1:
                given = ", ".join(f"{n}[{axis}]={shapes[n][axis]}" for n, axis in uses)
                raise EngineInputError(f"inputs share dim {sym!r} but differ: {given}")
        lengths = None
        if self._padded:
            lengths = {sym: shapes[n][axis] for sym, (n, axis) in self._padded.items()}
            shapes = {n: self._pad_shape(n, s, lengths) for n, s in shapes.items()}
        if self.profiles and not any(self._fits(p, shapes) for p in self.profiles):
            self._profile_error(shapes)
        key = tuple(shapes[n][1:] for n in self.names)
        return single, rows, key, lengths

    def _pad_shape(
        self, name: str, shape: tuple[int, ...], lengths: Mapping[str, int]
    ) -> tuple[int, ...]:
        if name not in self.pad_values:
            return shape
        dims = list(shape)
        for axis, d in enumerate(self._specs[name].shape):
            if axis and d in self._padded:
                size = lengths[str(d)]
                dims[axis] = next((b for b in self._buckets[str(d)] if b >= size), size)
        return tuple(dims)

    @staticmethod
    def _fits(profile: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> bool:
        return all(
            all(lo <= d <= hi for d, lo, hi in zip(s[1:], p.min[1:], p.max[1:]))
            for n, s in shapes.items()
            if (p := profile.get(n)) is not None
        )

    def _profile_error(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        ranges = []
        for i, p in enumerate(self.profiles):
            for n, s in shapes.items():
                if n in p:
                    for axis in range(1, len(s)):
                        lo, hi = p[n].min[axis], p[n].max[axis]
                        if not lo <= s[axis] <= hi:
                            ranges.append(
                                f"profile {i}: {n!r} dim {axis} is {s[axis]}, built for {lo}..{hi}"
                            )
        raise EngineInputError(
            "request shapes fit no built profile: "
            + "; ".join(ranges)
            + " — rebuild the engine with wider --shapes to accept them"
        )

    # -- in the worker -------------------------------------------------------------------------

    def stack(
        self, requests: Sequence[Request], rows: int, buffers: dict[Any, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The requests' ``rows`` rows as one batch (padded to the group's shape when padding
        is on), copied into ``buffers`` — the calling worker's own arrays, reused from batch to
        batch so that collating costs one copy and no fresh memory."""
        if len(requests) == 1 and requests[0].lengths is None:
            return requests[0].feeds
        key = requests[0].key
        feeds = {}
        for i, name in enumerate(self.names):
            parts = [r.feeds[name] for r in requests]
            target = key[i]
            buf = buffers.get((name, target))
            if buf is None or len(buf) < rows:
                buf = buffers[(name, target)] = np.empty((rows, *target), self._dtypes[name])
            out = buf[:rows]
            if not self._padded or all(p.shape[1:] == target for p in parts):
                np.concatenate(parts, out=out)
            else:
                out.fill(self.pad_values[name])
                start = 0
                for p in parts:
                    out[(slice(start, start + p.shape[0]), *map(slice, p.shape[1:]))] = p
                    start += p.shape[0]
            feeds[name] = out
        return feeds

    @staticmethod
    def detach(
        outputs: dict[str, np.ndarray], buffers: dict[Any, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """``outputs``, copying any that is a view of a collation buffer (an engine may return
        its input, e.g. an identity model): the next batch overwrites those buffers."""
        shared = np.may_share_memory
        for k, v in outputs.items():
            if v.base is None:  # owns its memory (a view of a buffer has that buffer as base)
                continue
            for b in buffers.values():
                if shared(v, b):
                    outputs = {**outputs, k: v.copy()}
                    break
        return outputs

    def split(
        self, outputs: Mapping[str, np.ndarray], requests: Sequence[Request]
    ) -> list[dict[str, np.ndarray]]:
        """Each request's rows of ``outputs``, in its own shape (a row, or its own batch)."""
        if all([r.single and r.lengths is None for r in requests]):
            # One row per request, the common case: iterating an array makes the row views in
            # C, against a Python-level index and dict per request (about 2.5x faster).
            n = len(requests)
            for name, value in outputs.items():
                if len(value) < n:  # never leave a future unresolved
                    raise BatcherError(
                        f"output {name!r} has {len(value)} rows for a batch of {n}: the engine "
                        "must return one row per input row; fix the engine or its export"
                    )
            if len(outputs) == 1:
                ((name, value),) = outputs.items()
                return [{name: row} for row in value[:n]]
            names = list(outputs)
            return [dict(zip(names, rows)) for rows in zip(*[v[:n] for v in outputs.values()])]
        results = []
        start = 0
        trim = self._out_trim
        for r in requests:
            index: Any = start if r.single else slice(start, start + r.rows)
            if r.lengths is None:
                results.append({k: v[index] for k, v in outputs.items()})
            else:
                res = {}
                for k, v in outputs.items():
                    cut = [index] + [slice(None)] * (v.ndim - 1)
                    for axis, sym in trim.get(k, ()):
                        cut[axis] = slice(0, r.lengths[sym])
                    res[k] = v[tuple(cut)]
                results.append(res)
            start += r.rows
        return results
