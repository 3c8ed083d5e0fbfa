"""XlaEngine: a deserialized StableHLO program, compiled per input shape on first use.

Batch sizes round up to power-of-two buckets (padded with copies of the last row, outputs cut
back), so a stream of batch sizes 1..N compiles only log2(N)+1 executables. Other dynamic dims
(a transformer's sequence length) compile per concrete size: padding them would change what
attention and normalization compute.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.backends.xla import program, values
from enginekit.config import BuildConfig
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import BuildError, EngineInputError, EnginekitError


def bucket(rows: int, cap: int | None) -> int:
    """The power-of-two batch ``rows`` is padded to, capped at the largest built batch."""
    size = 1 << max(rows - 1, 0).bit_length()
    return max(min(size, cap), rows) if cap else size


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` grown to ``rows`` rows with copies of its last row (real values, never NaN bait)."""
    extra = np.repeat(a[-1:], rows - a.shape[0], axis=0)
    return np.concatenate([a, extra])


class Program:
    """One exported program, its weights on the device, and its executables per input shape
    (compiled on first request, under a lock: two threads never compile one shape twice)."""

    def __init__(
        self,
        exported: Any,
        weights: Sequence[Any],
        dtypes: Sequence[np.dtype],
        compiler_options: Mapping[str, Any],
        device: Any = None,
        label: str = "",
    ) -> None:
        self.exported = exported
        self.label = label
        self.weights = tuple(weights)
        self._dtypes = list(dtypes)
        self._options = compiler_options
        self._device = device
        self._executables: dict[tuple[tuple[int, ...], ...], Any] = {}
        self.compile_s: dict[tuple[tuple[int, ...], ...], float] = {}
        self._lock = threading.Lock()

    def executable(self, shapes: Sequence[tuple[int, ...]]) -> Any:
        """The executable for these exact input shapes, compiled on first request."""
        key = tuple(tuple(int(d) for d in s) for s in shapes)
        found = self._executables.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._executables.get(key)
            if found is None:
                found, seconds = program.compile(
                    self.exported, self.weights, key, self._dtypes, self._options, self._device
                )
                self._executables[key] = found
                self.compile_s[key] = seconds
        return found

    def run(self, arrays: Sequence[np.ndarray]) -> Any:
        import jax

        run = self.executable([a.shape for a in arrays])
        with jax.enable_x64(True):
            return run(self.weights, tuple(arrays))

    def close(self) -> None:
        self._executables.clear()
        self.weights = ()


class XlaEngine(Engine):
    """An Engine over a ``jax.export`` program and its weights on one device.

    With value inputs (``values.find``), the program given is the one specialized to the
    build's example values; other values compile their own program on first use (an LRU of
    ``values.CACHE_SIZE`` per engine).

    Attributes:
        compiler_options: the XLA options every executable of this engine is compiled with.
        padding: whether batch sizes are padded to power-of-two buckets.
        value_inputs: inputs read on the host to pick (or compile) a specialized program.
    """

    def __init__(
        self,
        exported: Any,
        weights: Sequence[Any],
        manifest: Mapping[str, Any],
        compiler_options: Mapping[str, Any],
        buckets: str,
        device: Any = None,
        specializer: values.Specializer | None = None,
        build_values: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        config = BuildConfig.from_json(manifest["config"])
        super().__init__(
            [TensorSpec.from_json(i) for i in manifest["inputs"]],
            [TensorSpec.from_json(o) for o in manifest["outputs"]],
            config.profiles,
            dict(manifest),
        )
        self.compiler_options = dict(compiler_options)
        self._specializer = specializer
        self.value_inputs = specializer.names if specializer is not None else ()
        self.padding = (
            buckets == "pow2" and self._batched and self._outputs_batched and not self.value_inputs
        )
        self._device = device
        self._program_specs = [s for s in self.inputs if s.name not in self.value_inputs]
        self._out_names = [o.name for o in self.outputs]
        self._cache: values.ProgramCache[Program] = values.ProgramCache()
        # None: value inputs whose build-time example did not lower; all compile on first use.
        self._main: Program | None = None
        if exported is not None:
            dtypes = [np.dtype(s.dtype) for s in self._program_specs]
            self._main = Program(exported, weights, dtypes, self.compiler_options, device)
        if self._main is not None and self.value_inputs and build_values:
            self._cache.put(values.key(build_values), self._main)
            self._main.label = values.describe(build_values)

    @property
    def exported(self) -> Any:
        """The deserialized ``jax.export.Exported`` program (symbolic dims); with value inputs,
        the one specialized to the build's example values."""
        return self._main.exported if self._main is not None else None

    @property
    def program_inputs(self) -> tuple[str, ...]:
        """The inputs the compiled programs take (all but the value inputs)."""
        return tuple(s.name for s in self._program_specs)

    @property
    def programs(self) -> dict[str, float]:
        """Compiled executables so far: input shapes (and values, for value inputs) -> compile
        seconds."""
        held = [p for _, p in self._cache.items()] if self.value_inputs else [self._main]
        held = [p for p in held if p is not None]
        out = {}
        for p in held:
            for key, seconds in list(p.compile_s.items()):
                shapes = ", ".join("x".join(map(str, s)) for s in key)
                out[f"{p.label}: {shapes}" if p.label else shapes] = round(seconds, 4)
        return out

    def executable(self, shapes: Sequence[tuple[int, ...]]) -> Any:
        """The build program's executable for these exact shapes of :attr:`program_inputs`,
        compiled on first request."""
        if self._main is None:
            raise EnginekitError(
                "this XLA engine has no build-time program (its value inputs' example values "
                "did not lower); infer() compiles one per set of values"
            )
        return self._main.executable(shapes)

    def warm(self, batch_sizes: Sequence[int]) -> None:
        """Compile ahead for these batch sizes (their buckets), at the profiles' opt shape."""
        from enginekit.model import concrete_shapes

        profile = self.profiles[0] if self.profiles else None
        if self._main is None:
            return
        for b in batch_sizes:
            size = bucket(b, self._max_batch) if self.padding else b
            shapes = concrete_shapes(self.inputs, profile, "opt")
            self.executable([(size, *shapes[s.name][1:]) for s in self._program_specs])

    def _program(self, feeds: Mapping[str, np.ndarray]) -> Program:
        if not self.value_inputs:
            assert self._main is not None
            return self._main
        held = {n: np.asarray(feeds[n]) for n in self.value_inputs}
        return self._cache.get(values.key(held), lambda: self._specialize(held))

    def _specialize(self, held: dict[str, np.ndarray]) -> Program:
        assert self._specializer is not None
        try:
            exported, weights = self._specializer(held, self._program_specs)
        except BuildError as exc:
            raise EngineInputError(
                f"the XLA engine compiles a program for the values of {', '.join(held)}, and "
                f"{values.describe(held)} does not compile: {exc}. Pass values the model "
                "accepts"
            ) from None
        dtypes = [np.dtype(s.dtype) for s in self._program_specs]
        label = values.describe(held)
        return Program(exported, weights, dtypes, self.compiler_options, self._device, label)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        chosen = self._program(feeds)
        arrays = [feeds[s.name] for s in self._program_specs]
        rows = arrays[0].shape[0] if self.padding else 0
        size = bucket(rows, self._max_batch) if self.padding else rows
        if size != rows:
            arrays = [pad_rows(a, size) for a in arrays]
        outs = chosen.run(arrays)
        if size != rows:
            return {n: np.asarray(o)[:rows].copy() for n, o in zip(self._out_names, outs)}
        return {n: np.array(o) for n, o in zip(self._out_names, outs)}

    def _close(self) -> None:
        for _, p in self._cache.items():
            p.close()
        self._cache.clear()
        if self._main is not None:
            self._main.close()
