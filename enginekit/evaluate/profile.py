"""``profile``: where an engine's time goes, per op/kernel, from the backend's own profiler.

The backend's ``profile`` hook (see :mod:`enginekit.backends.profiling`) runs the batch with its
profiler on; this module aggregates the events into a table — each op's time per run, its share,
and for matrix products and convolutions the GFLOP/s achieved against a float32 matmul peak
(numpy, measured in the same run) — and writes them as a Chrome trace (``chrome://tracing``,
Perfetto).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from enginekit import backends as registry
from enginekit import target
from enginekit.backends.profiling import OpEvent
from enginekit.engine import Engine
from enginekit.errors import UsageError
from enginekit.files import atomic_write


@dataclasses.dataclass(frozen=True)
class OpProfile:
    """One op (node) of the backend's graph, averaged over the recorded runs.

    Attributes:
        name, op, kernel: as the backend reports them.
        calls: executions per run.
        ms: time per run in milliseconds.
        share: fraction of all op time in a run.
        gflop: GFLOP per run (matmuls and convolutions; None for other ops).
        gflops: achieved GFLOP/s (None where ``gflop`` is).
        of_peak: ``gflops`` over the float32 matmul peak.
    """

    name: str
    op: str
    kernel: str
    calls: float
    ms: float
    share: float
    gflop: float | None
    gflops: float | None
    of_peak: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProfileReport:
    """The per-op table of one engine on one batch.

    Attributes:
        backend, precision: the engine's.
        shapes: the input shapes profiled.
        runs, warmup: recorded and unrecorded runs.
        op_ms: total op time per run (ms); ``infer_ms`` the mean wall time of ``Engine.infer``
            on the same batch (the difference is framework overhead and gaps between ops).
        peak_gflops: float32 matmul GFLOP/s of this host measured in the same run (numpy).
        ops: every op, slowest first.
        events: the raw events (for the trace).
    """

    backend: str
    precision: str
    shapes: Mapping[str, tuple[int, ...]]
    runs: int
    warmup: int
    op_ms: float
    infer_ms: float
    peak_gflops: float
    ops: tuple[OpProfile, ...]
    events: tuple[OpEvent, ...] = dataclasses.field(repr=False, default=())

    @property
    def gflops(self) -> float | None:
        """The whole engine's GFLOP/s (counted ops over the op time), None if none counted."""
        gflop = sum(o.gflop for o in self.ops if o.gflop is not None)
        return gflop / (self.op_ms / 1e3) if gflop and self.op_ms else None

    def by_op_type(self) -> list[tuple[str, float, float]]:
        """(op type, ms per run, share) summed over nodes, slowest first."""
        sums: dict[str, float] = {}
        for o in self.ops:
            sums[o.op] = sums.get(o.op, 0.0) + o.ms
        total = self.op_ms or 1.0
        return sorted(((k, v, v / total) for k, v in sums.items()), key=lambda t: -t[1])

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "runs": self.runs,
            "warmup": self.warmup,
            "op_ms": self.op_ms,
            "infer_ms": self.infer_ms,
            "peak_gflops": self.peak_gflops,
            "gflops": self.gflops,
            "host": {"cpu": target.cpu_name(), "isa": sorted(target.cpu_flags())},
            "by_op_type": [{"op": k, "ms": v, "share": s} for k, v, s in self.by_op_type()],
            "ops": [o.to_json() for o in self.ops[:top]],
        }

    def table(self, top: int = 15) -> str:
        """The report as text: totals, the top ops, and time by op type."""
        whole = self.gflops
        lines = [
            f"{self.backend} {self.precision}  "
            + "  ".join(f"{k}={'x'.join(map(str, v))}" for k, v in self.shapes.items()),
            f"op time {self.op_ms:.3f} ms/run, infer {self.infer_ms:.3f} ms "
            f"({self.runs} runs after {self.warmup} warm-up); float32 matmul peak "
            f"{self.peak_gflops:.1f} GFLOP/s"
            + (f"; engine {whole:.1f} GFLOP/s ({whole / self.peak_gflops:.0%})" if whole else ""),
            "",
            f"{'op':<40} {'type':<18} {'kernel':<24} {'ms':>8} {'share':>6} {'GFLOP/s':>8} {'peak':>5}",
        ]
        for o in self.ops[:top]:
            rate = f"{o.gflops:8.1f}" if o.gflops is not None else f"{'':8}"
            peak = f"{o.of_peak:5.0%}" if o.of_peak is not None else f"{'':5}"
            lines.append(
                f"{o.name[:40]:<40} {o.op[:18]:<18} {o.kernel[:24]:<24} {o.ms:8.3f} "
                f"{o.share:6.1%} {rate} {peak}"
            )
        if len(self.ops) > top:
            rest = self.ops[top:]
            lines.append(
                f"{f'... {len(rest)} more ops':<84} {sum(o.ms for o in rest):8.3f} "
                f"{sum(o.share for o in rest):6.1%}"
            )
        lines += [
            "",
            "by op type: " + ", ".join(f"{k} {s:.0%}" for k, _, s in self.by_op_type()[:8]),
        ]
        return "\n".join(lines)

    def chrome_trace(self) -> dict[str, Any]:
        """The events in Chrome's trace event format (open in chrome://tracing or Perfetto).

        Backends that report durations only (OpenVINO) are laid end to end in graph order,
        one run after another.
        """
        trace = []
        cursor: dict[int, float] = {}
        for e in self.events:
            if e.start_us is not None:
                start = e.start_us
            else:
                start = cursor.get(e.run, e.run * (self.op_ms * 1e3 * 1.05))
                cursor[e.run] = start + e.dur_us
            trace.append(
                {
                    "name": e.name,
                    "cat": e.op,
                    "ph": "X",
                    "ts": start,
                    "dur": e.dur_us,
                    "pid": 0,
                    "tid": e.run,
                    "args": {"op": e.op, "kernel": e.kernel, "run": e.run}
                    | ({"gflop": e.flops / 1e9} if e.flops else {}),
                }
            )
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {"backend": self.backend, "precision": self.precision},
        }

    def write_trace(self, path: str | os.PathLike) -> Path:
        """Write :meth:`chrome_trace` to ``path`` (atomically)."""
        out = Path(path)
        with atomic_write(out, "w") as f:
            json.dump(self.chrome_trace(), f)
        return out


#: Matrix sizes the matmul peak tries, in order: a 1024 product is over before a BLAS thread
#: pool reaches its stride on some hosts (measured on a 2-core EPYC: 1024 gave ~25 GFLOP/s,
#: 2048 ~40), so the search goes on while a larger size is still faster (for either library).
PEAK_SIZES = (1024, 2048)


def matmul_peak(n: int | None = None, repeats: int = 3) -> float:
    """This host's float32 matmul GFLOP/s: the best of :func:`matmul_rates`' GEMM libraries."""
    return max(matmul_rates(n, repeats).values())


def matmul_rates(n: int | None = None, repeats: int = 3) -> dict[str, float]:
    """Float32 matmul GFLOP/s of each GEMM library here: numpy's BLAS and ONNX Runtime's MLAS
    (when installed), each the best of ``repeats`` products at each of :data:`PEAK_SIZES` (or
    at ``n`` only), stopping when a larger size is no faster. Both, because neither reaches the
    host's peak everywhere: on a 2-core EPYC with full-width AVX-512 (Zen 5 by its flags)
    numpy's BLAS read 91-207 GFLOP/s where MLAS ran 290 on BERT-base's GEMMs."""
    rng = np.random.default_rng(0)
    rates: dict[str, float] = {}
    for size in (n,) if n is not None else PEAK_SIZES:
        a = rng.standard_normal((size, size), dtype=np.float32)
        b = rng.standard_normal((size, size), dtype=np.float32)
        products: dict[str, Callable[[], Any]] = {"numpy": partial(np.matmul, a, b)}
        mlas = _ort_matmul(size)
        if mlas is not None:
            products["onnxruntime"] = partial(mlas, a, b)
        grew = False
        for name, product in products.items():
            product()
            best = min(_seconds(product) for _ in range(repeats))
            rate = 2.0 * size**3 / best / 1e9
            if rate >= rates.get(name, 0.0) * 1.05:
                grew = True
            rates[name] = max(rates.get(name, 0.0), rate)
        if not grew:
            break
    return rates


def _seconds(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _ort_matmul(size: int) -> Any:
    """``(a, b) -> a @ b`` on an ONNX Runtime session (default options), or None without it."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        return None
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [size, size]) for x in "abc"]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "peak", io[:2], io[2:]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda a, b: session.run(None, {"a": a, "b": b})[0]


def supported() -> list[str]:
    """Backends whose module has a ``profile`` hook (registered ones, installed or not)."""
    out = []
    for name in registry.names():
        try:
            if getattr(registry.get(name), "profile", None) is not None:
                out.append(name)
        except Exception:  # a broken third-party backend must not break this listing
            continue
    return out


def profile(
    engine: Engine | str | os.PathLike,
    batch: int | None = None,
    feeds: Mapping[str, np.ndarray] | None = None,
    runs: int = 10,
    warmup: int = 3,
) -> ProfileReport:
    """Per-op times of an engine (or an artifact path) on one batch, with its backend's profiler.

    Args:
        engine: a loaded/built Engine, or the path of an artifact.
        batch: the batch size of random inputs (default: the profile's opt shapes).
        feeds: inputs to profile on instead of random ones.
        runs, warmup: recorded runs, and unrecorded runs before them.

    Raises:
        UsageError: the backend has no profiler hook (the message names those that do), the
            engine was not made from an artifact, or bad arguments.
    """
    from enginekit.evaluate.bench import _shapes_for

    if runs < 1 or warmup < 0:
        raise UsageError(f"runs={runs}, warmup={warmup}: need runs >= 1 and warmup >= 0")
    if not isinstance(engine, Engine):
        engine = registry.load(engine)
    artifact = engine.artifact
    if artifact is None:
        raise UsageError(
            "this engine has no artifact to profile: build it with enginekit.build or load it "
            "with enginekit.load"
        )
    name = str(artifact.manifest["backend"]["name"])
    hook = getattr(registry.get(name), "profile", None)
    if hook is None:
        raise UsageError(
            f"profiling is not supported by the {name} backend; backends with a profiler: "
            f"{', '.join(supported()) or 'none'}"
        )
    if feeds is None:
        if batch is None:
            batch = _opt_batch(engine)
        from enginekit.model import random_feeds

        shapes = _shapes_for(engine, batch)
        feeds = random_feeds(engine.inputs, shapes)
    feeds = dict(feeds)
    engine.infer(feeds)  # validates the feeds against the engine, like any call
    peak = matmul_peak()
    events: Sequence[OpEvent] = hook(artifact, feeds, runs, warmup)
    infer_ms = _infer_ms(engine, feeds, runs)
    return _aggregate(artifact.manifest, feeds, runs, warmup, events, peak, infer_ms)


def _opt_batch(engine: Engine) -> int:
    for p in engine.profiles:
        for s in p.values():
            return s.opt[0] if s.opt else 1
    return 1


def _infer_ms(engine: Engine, feeds: dict[str, np.ndarray], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.infer(feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _aggregate(
    manifest: Mapping[str, Any],
    feeds: Mapping[str, np.ndarray],
    runs: int,
    warmup: int,
    events: Sequence[OpEvent],
    peak: float,
    infer_ms: float,
) -> ProfileReport:
    groups: dict[tuple[str, str, str], list[OpEvent]] = {}
    for e in events:
        groups.setdefault((e.name, e.op, e.kernel), []).append(e)
    op_ms = sum(e.dur_us for e in events) / runs / 1e3
    ops = []
    for (name, op, kernel), evs in groups.items():
        ms = sum(e.dur_us for e in evs) / runs / 1e3
        counted = [e.flops for e in evs if e.flops is not None]
        gflop = sum(counted) / runs / 1e9 if counted else None
        rate = gflop / (ms / 1e3) if gflop is not None and ms > 0 else None
        ops.append(
            OpProfile(
                name, op, kernel, len(evs) / runs, ms, ms / op_ms if op_ms else 0.0, gflop,
                rate, rate / peak if rate is not None else None,
            )
        )  # fmt: skip
    ops.sort(key=lambda o: -o.ms)
    return ProfileReport(
        backend=str(manifest["backend"]["name"]),
        precision=str(manifest.get("precision", "fp32")),
        shapes={k: tuple(v.shape) for k, v in feeds.items()},
        runs=runs,
        warmup=warmup,
        op_ms=op_ms,
        infer_ms=infer_ms,
        peak_gflops=peak,
        ops=tuple(ops),
        events=tuple(events),
    )
