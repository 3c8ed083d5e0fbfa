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

from enginekit.backends.xla import program
from enginekit.config import BuildConfig
from enginekit.engine import Engine, TensorSpec


def bucket(rows: int, cap: int | None) -> int:
    """The power-of-two batch ``rows`` is padded to, capped at the largest built batch."""
    size = 1 << max(rows - 1, 0).bit_length()
    return max(min(size, cap), rows) if cap else size


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` grown to ``rows`` rows with copies of its last row (real values, never NaN bait)."""
    extra = np.repeat(a[-1:], rows - a.shape[0], axis=0)
    return np.concatenate([a, extra])


class XlaEngine(Engine):
    """An Engine over a ``jax.export`` program and its weights on one device.

    Attributes:
        compiler_options: the XLA options every executable of this engine is compiled with.
        padding: whether batch sizes are padded to power-of-two buckets.
    """

    def __init__(
        self,
        exported: Any,
        weights: Sequence[Any],
        manifest: Mapping[str, Any],
        compiler_options: Mapping[str, Any],
        buckets: str,
        device: Any = None,
    ) -> None:
        config = BuildConfig.from_json(manifest["config"])
        super().__init__(
            [TensorSpec.from_json(i) for i in manifest["inputs"]],
            [TensorSpec.from_json(o) for o in manifest["outputs"]],
            config.profiles,
            dict(manifest),
        )
        self.compiler_options = dict(compiler_options)
        self.padding = buckets == "pow2" and self._batched and self._outputs_batched
        self._exported = exported
        self._weights = tuple(weights)
        self._device = device
        self._dtypes = [np.dtype(s.dtype) for s in self.inputs]
        self._out_names = [o.name for o in self.outputs]
        self._programs: dict[tuple[tuple[int, ...], ...], Any] = {}
        self._compile_s: dict[tuple[tuple[int, ...], ...], float] = {}
        self._lock = threading.Lock()

    @property
    def exported(self) -> Any:
        """The deserialized ``jax.export.Exported`` program (symbolic dims)."""
        return self._exported

    @property
    def programs(self) -> dict[str, float]:
        """Compiled executables so far: input shapes -> compile seconds."""
        with self._lock:
            return {
                ", ".join("x".join(map(str, s)) for s in key): round(seconds, 4)
                for key, seconds in self._compile_s.items()
            }

    def executable(self, shapes: Sequence[tuple[int, ...]]) -> Any:
        """The executable for these exact input shapes, compiled on first request."""
        key = tuple(tuple(int(d) for d in s) for s in shapes)
        found = self._programs.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._programs.get(key)
            if found is None:
                found, seconds = program.compile(
                    self._exported,
                    self._weights,
                    key,
                    self._dtypes,
                    self.compiler_options,
                    self._device,
                )
                self._programs[key] = found
                self._compile_s[key] = seconds
        return found

    def warm(self, batch_sizes: Sequence[int]) -> None:
        """Compile ahead for these batch sizes (their buckets), at the profiles' opt shape."""
        from enginekit.model import concrete_shapes

        profile = self.profiles[0] if self.profiles else None
        for b in batch_sizes:
            size = bucket(b, self._max_batch) if self.padding else b
            shapes = concrete_shapes(self.inputs, profile, "opt")
            self.executable([(size, *shapes[s.name][1:]) for s in self.inputs])

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import jax

        arrays = [feeds[n] for n in self._names]
        rows = arrays[0].shape[0] if self.padding else 0
        size = bucket(rows, self._max_batch) if self.padding else rows
        if size != rows:
            arrays = [pad_rows(a, size) for a in arrays]
        run = self.executable([a.shape for a in arrays])
        with jax.enable_x64(True):
            outs = run(self._weights, tuple(arrays))
        if size != rows:
            return {n: np.asarray(o)[:rows].copy() for n, o in zip(self._out_names, outs)}
        return {n: np.array(o) for n, o in zip(self._out_names, outs)}

    def _close(self) -> None:
        self._programs.clear()
        self._weights = ()
