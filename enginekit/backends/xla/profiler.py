"""Per-HLO-op times of an XLA engine, from the JAX profiler, with FLOPs from the optimized HLO.

XLA's CPU runtime runs the entry computation as thunks, one per HLO instruction left after
fusion (``conv_general_dilated.1``, ``transpose_copy_fusion``, ``dot_general.3``); under
``jax.profiler.trace`` each thunk leaves an event carrying ``hlo_op`` and the call's
``run_id``. Those events, read back with ``jax.profiler.ProfileData`` (no TensorBoard
needed), are the table's rows. FLOPs come from the executable's optimized HLO text: a
``convolution`` or ``dot`` instruction counts 2 × K per output element, a fusion the sum of the
convolutions and dots it calls — the same count XLA's HLO cost analysis makes for these ops.
"""

from __future__ import annotations

import glob
import math
import re
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.backends.profiling import OpEvent
from enginekit.errors import BuildError

if TYPE_CHECKING:
    from enginekit.backends.xla.runtime import XlaEngine

# ``%name = f32[4,14,14,8]{3,2,1,0} opcode(%a, %b), attr=...`` (tuple-typed results have no
# single shape and are skipped).
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\][^ ]*\s+([\w\-]+)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _operands(rest: str) -> list[str]:
    """Operand names of an instruction (the text up to its closing parenthesis)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def hlo_flops(text: str) -> dict[str, float]:
    """Instruction name -> FLOPs, for every convolution, dot, and fusion calling them, in an
    optimized HLO module's text."""
    shapes: dict[str, tuple[int, ...]] = {}
    parsed: list[tuple[str, str, str, tuple[int, ...], list[str], str]] = []
    computation = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and " = " not in line:
            computation = header.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, dims, opcode, rest = m.group(1), _dims(m.group(2)), m.group(3), m.group(4)
        shapes[name] = dims
        parsed.append((computation, name, opcode, dims, _operands(rest), rest))
    own: dict[str, float] = {}
    per_computation: dict[str, float] = {}
    calls: dict[str, str] = {}
    for comp, name, opcode, out, operands, rest in parsed:
        value = _op_flops(opcode, out, [shapes.get(o) for o in operands], rest)
        if value is not None:
            own[name] = value
            per_computation[comp] = per_computation.get(comp, 0.0) + value
        if opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            if called:
                calls[name] = called.group(1)
    for name, comp in calls.items():
        if per_computation.get(comp):
            own[name] = per_computation[comp]
    return own


def _op_flops(
    opcode: str, out: tuple[int, ...], operands: list[tuple[int, ...] | None], rest: str
) -> float | None:
    if opcode == "convolution" and len(operands) >= 2 and operands[1] is not None:
        kernel = operands[1]
        labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
        o = labels.group(1).find("o") if labels else -1
        if o < 0 or o >= len(kernel) or not kernel[o]:
            return None
        return 2.0 * math.prod(out) * math.prod(kernel) / kernel[o]
    if opcode == "dot" and operands and operands[0] is not None:
        lhs = operands[0]
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        axes = _dims(contracting.group(1)) if contracting else ()
        k = math.prod(lhs[a] for a in axes if a < len(lhs)) if axes else 1
        return 2.0 * math.prod(out) * k
    return None


def profile(
    engine: XlaEngine, feeds: Mapping[str, np.ndarray], runs: int, warmup: int
) -> list[OpEvent]:
    """Per-HLO-op times of ``engine`` on ``feeds`` from the JAX profiler's thunk events:
    ``warmup`` runs outside the trace, ``runs`` inside it."""
    import jax
    from jax.profiler import ProfileData

    tmp = tempfile.mkdtemp(prefix="enginekit-xla-profile-")
    try:
        feeds = dict(feeds)
        for _ in range(max(warmup, 1)):  # at least one: the compile stays out of the trace
            engine.infer(feeds)
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # the Python tracer's events would slow every call
        with jax.profiler.trace(tmp, profiler_options=options):
            for _ in range(runs):
                engine.infer(feeds)
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not files:
            raise BuildError(f"the JAX profiler wrote no trace under {tmp}")
        data = ProfileData.from_file(files[0])
        flops = hlo_flops(engine.executable(_run_shapes(engine, feeds)).as_text() or "")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _events(data, flops, runs)


def _run_shapes(engine: XlaEngine, feeds: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    """The input shapes ``engine.infer(feeds)`` runs its executable at (batch padded to its
    bucket when the engine pads)."""
    from enginekit.backends.xla.runtime import bucket

    shapes = [tuple(np.shape(feeds[n])) for n in engine._names]
    if engine.padding and shapes:
        rows = bucket(shapes[0][0], engine._max_batch)
        shapes = [(rows, *s[1:]) for s in shapes]
    return shapes


def _events(data: Any, flops: Mapping[str, float], runs: int) -> list[OpEvent]:
    """The thunk events of every host thread, numbered into runs by their ``run_id``."""
    raw = []
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                if op is None or "run_id" not in stats:
                    continue
                raw.append((float(ev.start_ns), float(ev.duration_ns), str(op), stats["run_id"]))
    raw.sort()
    order: dict[Any, int] = {}
    for _, _, _, run_id in raw:
        order.setdefault(run_id, len(order))
    if len(order) != runs:
        raise BuildError(
            f"the JAX profiler recorded {len(order)} XLA runs, expected {runs}: another "
            "computation ran during the profile, or the engine split the batch"
        )
    origin = raw[0][0] if raw else 0.0
    return [
        OpEvent(
            name=op,
            op=_op_type(op),
            kernel=op,
            run=order[run_id],
            dur_us=dur / 1e3,
            start_us=(start - origin) / 1e3,
            flops=flops.get(op),
        )
        for start, dur, op, run_id in raw
    ]


def _op_type(name: str) -> str:
    """``conv_general_dilated.1`` -> ``conv_general_dilated``; ``transpose_copy_fusion`` stays."""
    return name.rsplit(".", 1)[0] if re.search(r"\.\d+$", name) else name
