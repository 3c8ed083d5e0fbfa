"""StableHLO programs: export once with symbolic dims, compile per concrete shape.

``export`` traces the lowered function with ``jax.export`` — dims that vary across the build's
profiles (batch, seq) become symbolic — and returns bytes that any process can deserialize.
``compile`` turns the deserialized program into an XLA executable for one concrete input shape,
with per-executable compiler options (``Lowered.compile(compiler_options=...)``), so each
engine carries its own XLA flags without touching the process-wide ``XLA_FLAGS``.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import ArtifactError, BuildError

Dim = Any  # an int or a jax symbolic dimension


def symbolic_dims(
    specs: Sequence[TensorSpec], profiles: Sequence[Mapping[str, ShapeProfile]]
) -> dict[str, list[int | str]]:
    """Per input, each dim as an int or the name of the symbol it is exported with.

    A dim stays symbolic when the model leaves it open and the profiles do not pin it to one
    size; symbols keep the model's own names (``batch``, ``seq``), so inputs sharing a name
    share the dim.
    """
    out: dict[str, list[int | str]] = {}
    for spec in specs:
        dims: list[int | str] = []
        for axis, d in enumerate(spec.shape):
            if isinstance(d, int):
                dims.append(d)
                continue
            ranges = {
                (p[spec.name].min[axis], p[spec.name].max[axis]) for p in profiles if spec.name in p
            }
            if len(ranges) == 1 and len(set(next(iter(ranges)))) == 1:
                dims.append(next(iter(ranges))[0])
                continue
            dims.append(_symbol(d, spec.name, axis))
        out[spec.name] = dims
    return out


def symbol_bounds(
    specs: Sequence[TensorSpec],
    profiles: Sequence[Mapping[str, ShapeProfile]],
    dims: Mapping[str, Sequence[int | str]],
) -> dict[str, list[int]]:
    """Per symbol, the smallest and largest size the build's profiles allow it.

    They become ``jax.export`` constraints (``seq <= 512``): shape arithmetic the profiles
    decide (``x[:, :seq]`` of a 512-long position table is ``seq`` long) then lowers, instead of
    failing as an inconclusive comparison. XLA checks them when a program is called.
    """
    bounds: dict[str, list[int]] = {}
    for spec in specs:
        for axis, d in enumerate(dims.get(spec.name, ())):
            if not isinstance(d, str):
                continue
            for p in profiles:
                if spec.name not in p:
                    continue
                lo, hi = int(p[spec.name].min[axis]), int(p[spec.name].max[axis])
                have = bounds.setdefault(d, [lo, hi])
                have[0], have[1] = min(have[0], lo), max(have[1], hi)
    return bounds


def constraints(bounds: Mapping[str, Sequence[int]]) -> tuple[str, ...]:
    """``jax.export`` constraint strings for symbol bounds (a lower bound of 1 is implied)."""
    out: list[str] = []
    for name, (lo, hi) in sorted(bounds.items()):
        if lo > 1:
            out.append(f"{name} >= {lo}")
        out.append(f"{name} <= {hi}")
    return tuple(out)


def _symbol(name: str, input_name: str, axis: int) -> str:
    if name in ("?", ""):
        name = f"{input_name}_{axis}"
    clean = re.sub(r"\W", "_", name)
    return clean if re.match(r"[A-Za-z_]", clean) else f"d_{clean}"


def _abstract_inputs(
    specs: Sequence[TensorSpec],
    dims: Mapping[str, Sequence[int | str]],
    bounds: Mapping[str, Sequence[int]] | None = None,
) -> tuple[Any, ...]:
    import jax
    from jax import export

    symbols = sorted({d for ds in dims.values() for d in ds if isinstance(d, str)})
    wanted = constraints({k: v for k, v in (bounds or {}).items() if k in symbols})
    scope = (
        dict(zip(symbols, export.symbolic_shape(", ".join(symbols), constraints=wanted)))
        if symbols
        else {}
    )
    return tuple(
        jax.ShapeDtypeStruct(
            tuple(scope[d] if isinstance(d, str) else d for d in dims[s.name]), np.dtype(s.dtype)
        )
        for s in specs
    )


def _no_caller_locations() -> Any:
    """Keep the caller's Python traceback out of the program's debug locations.

    By default JAX records the whole traceback of the trace in the MLIR locations, so the bytes
    of the serialized program would depend on (and reveal) the user's script and call site, and
    two builds of one model from different places would differ. The public ``jax.config`` only
    offers a process-wide switch; the flag's own state object is a context manager.
    """
    from jax._src import config as jax_config

    state = getattr(jax_config, "include_full_tracebacks_in_locations", None)
    return state(False) if state is not None else contextlib.nullcontext()


def export(
    fn: Any,
    weights: Sequence[np.ndarray],
    specs: Sequence[TensorSpec],
    dims: Mapping[str, Sequence[int | str]],
    platform: str,
    bounds: Mapping[str, Sequence[int]] | None = None,
) -> Any:
    """Trace ``fn(weights, inputs)`` once and return the ``jax.export.Exported`` program.

    ``bounds`` (symbol -> [min, max], from :func:`symbol_bounds`) become symbolic-shape
    constraints.

    Raises:
        BuildError: the model cannot be traced with these symbolic dims (the message says
            which node and how to pin the dim).
    """
    import jax
    from jax import export as jax_export

    weight_specs = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"), _no_caller_locations():
        try:
            return jax_export.export(jax.jit(fn), platforms=[platform])(
                weight_specs, _abstract_inputs(specs, dims, bounds)
            )
        except BuildError:
            raise
        except Exception as exc:
            symbolic = sorted({d for ds in dims.values() for d in ds if isinstance(d, str)})
            hint = (
                f" The symbolic dims {', '.join(symbolic)} may be what it cannot handle: pin "
                "them with shapes= (min == max) to export for fixed sizes."
                if symbolic
                else ""
            )
            raise BuildError(
                f"tracing the model for XLA failed: {type(exc).__name__}: {exc}.{hint}"
            ) from exc


def serialize(exported: Any) -> bytes:
    """The program as portable bytes (StableHLO + calling convention; no pickle)."""
    return bytes(exported.serialize())


def deserialize(data: bytes) -> Any:
    """Inverse of :func:`serialize`.

    Raises:
        ArtifactError: the bytes are not a serialized jax.export program.
    """
    from jax import export as jax_export

    try:
        return jax_export.deserialize(bytearray(data))
    except Exception as exc:
        raise ArtifactError(
            f"the StableHLO payload cannot be read ({type(exc).__name__}: {exc}); rebuild the "
            "engine with this jax version"
        ) from None


def compile(
    exported: Any,
    weights: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    compiler_options: Mapping[str, Any] | None,
    device: Any = None,
) -> tuple[Any, float]:
    """An executable for one concrete input shape, and the seconds its compile took."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
    weight_specs = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding) for w in weights)
    input_specs = tuple(
        jax.ShapeDtypeStruct(tuple(s), d, sharding=sharding) for s, d in zip(shapes, dtypes)
    )
    start = time.perf_counter()
    with jax.enable_x64(True):
        lowered = jax.jit(exported.call).lower(weight_specs, input_specs)
        compiled = lowered.compile(dict(compiler_options) if compiler_options else None)
    return compiled, time.perf_counter() - start


def hlo_summary(compiled: Any) -> dict[str, Any]:
    """Counts from an executable's optimized HLO: fusions (by kind), convolutions, dots,
    transposes, and library custom calls (oneDNN, XNNPACK/YNNPACK fusions)."""
    text = compiled.as_text() or ""
    entry = _entry_computation(text)
    kinds: dict[str, int] = {}
    for match in re.finditer(r"\bfusion\([^\n]*?kind=(k\w+)", entry):
        kinds[match.group(1)] = kinds.get(match.group(1), 0) + 1
    library = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    library += sorted(set(re.findall(r"__(?:ynn|xnn|onednn)_fusion", text)))
    return {
        "fusions": sum(kinds.values()),
        "fusion_kinds": kinds,
        "convolutions": len(re.findall(r"\bconvolution\(", text)),
        "dots": len(re.findall(r"\bdot\(", text)),
        "transposes": len(re.findall(r"\btranspose\(", text)),
        "entry_instructions": sum(1 for line in entry.splitlines() if " = " in line),
        "library_calls": library,
        "hlo_lines": text.count("\n"),
    }


def _entry_computation(text: str) -> str:
    start = text.find("\nENTRY ")
    if start < 0:
        return text
    end = text.find("\n}\n", start)
    return text[start : end if end > 0 else len(text)]
