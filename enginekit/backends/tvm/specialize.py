"""Static-shape specializations: the dynamic program compiled once more per batch size users
call most, with every dim fixed.

With a symbolic batch (or sequence) the default schedules tile kernels over extents unknown at
build time, and the Relax VM computes shapes and allocates every intermediate on each call. A
static module knows every extent: kernels are tiled, vectorized and unrolled on real sizes, and
memory is planned once at build time (``StaticPlanBlockMemory`` sees fixed sizes). On a small
BERT it cut the latency 1.4-2.4x at batch 1 and 16; on a ResNet-style CNN (batch the only
symbolic dim) no difference was measurable (its kernels get the same schedules either way).

``specialize="auto"`` (the default) compiles batch 1 and the profile's opt batch where an
input has a symbolic dim besides the batch (a sequence length), with the profile's opt shape
for every other dim, and nothing for a model whose only symbolic dim is the batch; the engine runs a static module when a batch's
shapes equal its shapes exactly, the dynamic module otherwise. Each static module is checked
against ONNX Runtime at build time; one that fails to compile or to match is dropped (the
dynamic module serves its shapes) and the manifest says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.errors import BuildError, VerificationError
from enginekit.progress import step

if TYPE_CHECKING:
    from enginekit.config import BuildConfig
    from enginekit.model import Model

log = logging.getLogger(__name__)

AUTO = "auto"


def _batch_ranges(config: BuildConfig) -> list[tuple[int, int]]:
    """Each profile's batch range (its first input's leading dim)."""
    return [(p[n].min[0], p[n].max[0]) for p in config.profiles for n in list(p)[:1] if p[n].min]


def parse_specialize(
    value: Any, model: Model, config: BuildConfig, default_batch: int, tuned: Sequence[int] = ()
) -> tuple[int, ...]:
    """The batch sizes to compile static modules for (none for a model without a symbolic
    leading dim, and none that a tuned module already serves).

    Accepted: ``"auto"`` / None (batch 1 and the profile's opt batch when an input has a
    symbolic dim besides the leading one, else none), False or ``[]`` (none), a batch size or
    a list of them.

    Raises:
        BuildError: not one of those, or a batch size outside every profile's batch range.
    """
    if value is False or value == []:
        return ()
    batched = any(s.shape and isinstance(s.shape[0], str) for s in model.inputs)
    ranges = _batch_ranges(config)
    auto = value is None or value == AUTO
    if auto:
        # Only where an input has a symbolic dim besides the leading one (a sequence): there
        # the dynamic kernels' inner extents are unknown and stay scalar (a small BERT: 1.4-2.4x
        # faster static). With the batch the only symbolic dim the dynamic kernels get the
        # same schedules as static ones: a ResNet-style CNN measured no difference at batch 1
        # or 16 beyond the host's noise, so the compile is not spent.
        inner = any(isinstance(d, str) for s in model.inputs for d in s.shape[1:])
        sizes = [1, default_batch] if inner else []
    elif isinstance(value, int) and not isinstance(value, bool):
        sizes = [value]
    elif isinstance(value, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in value
    ):
        sizes = list(value)
    else:
        raise BuildError(
            f"specialize={value!r}: expected 'auto', False, a batch size or a list of them "
            "such as [1, 8]"
        )
    if any(b <= 0 for b in sizes):
        raise BuildError(f"specialize={value!r}: batch sizes must be positive whole numbers")

    def fits(b: int) -> bool:
        return not ranges or any(lo <= b <= hi for lo, hi in ranges)

    if not auto:
        outside = [b for b in sizes if not fits(b)]
        if outside:
            shown = ", ".join(f"{lo}..{hi}" for lo, hi in ranges)
            raise BuildError(
                f"specialize batch size {outside[0]} lies outside every profile's batch range "
                f"({shown}); name sizes the engine can be called with"
            )
    if not batched:
        return ()
    return tuple(sorted({b for b in sizes if fits(b)} - set(tuned)))


def static_shapes(model: Model, config: BuildConfig, batch: int) -> dict[str, tuple[int, ...]]:
    """Input shapes of the static module for ``batch``: the profile's opt with its batch.

    Raises:
        BuildError: ``batch`` lies outside every profile's batch range.
    """
    from enginekit.model import concrete_shapes

    profile = next(
        (p for p in config.profiles if all(p[n].min[0] <= batch <= p[n].max[0] for n in p)),
        None,
    )
    if config.profiles and profile is None:
        ranges = "; ".join(
            f"{n}: {p[n].min[0]}..{p[n].max[0]}" for p in config.profiles for n in list(p)[:1]
        )
        raise BuildError(
            f"tune batch size {batch} lies outside every profile's batch range ({ranges}); "
            "tune sizes the engine can be called with"
        )
    shapes = concrete_shapes(model.inputs, profile, "opt", batch=batch)
    batched = [s.name for s in model.inputs if s.shape and isinstance(s.shape[0], str)]
    return {n: ((batch,) + s[1:] if n in batched else s) for n, s in shapes.items()}


def compile_library(
    mod: Any,
    target: Any,
    opts: dict[str, Any],
    database: Any,
    path: Path,
    knobs: Mapping[str, Any] | None = None,
) -> tuple[list[str], set[str]]:
    """Schedule, compile and export ``mod`` (``knobs``: enginekit's tuner's choices by
    kernel key); returns (tuned kernels, scheduled kernels)."""
    from enginekit.backends.tvm import lower

    executable, scheduled, tuned = lower.schedule_and_compile(
        mod, target, opts["schedule"], database, knobs
    )
    done = {k["name"] for k in lower.kernel_summary(scheduled, blocks=False) if k["scheduled"]}
    try:
        executable.export_library(str(path))
    except Exception as exc:
        raise BuildError(
            f"linking {path.name} for {target.kind.name} failed ({lower.error_line(exc)}); "
            "a target of another architecture needs that architecture's C compiler (set CC)"
        ) from None
    return tuned, done


def compile_static(
    model: Model,
    config: BuildConfig,
    opts: dict[str, Any],
    target: Any,
    batches: Sequence[int],
    workdir: Path,
    example: Mapping[str, Any],
    verify: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Compile (and with ``verify``, check) one static module per batch size.

    Returns:
        (the module entries for the manifest, what was specialized: batch sizes, seconds and
        a note per dropped module).
    """
    from enginekit.backends.tvm import frontend, lower

    modules: list[dict[str, Any]] = []
    notes: list[str] = []
    start = time.perf_counter()
    for batch in batches:
        try:
            shapes = static_shapes(model, config, batch)
        except BuildError as exc:  # a symbolic dim the profile does not fix
            notes.append(f"batch {batch}: not specialized ({exc})")
            continue
        name = f"model-static-b{batch}.so"
        try:
            with step(f"compiling {name} (static shapes, batch {batch})"):
                mod = frontend.import_onnx(model, shapes, values=example)
                _, fused, _ = lower.optimize(mod, target, opts["layout"], opts["precision"])
                compile_library(fused, target, opts, None, workdir / name)
        except BuildError as exc:
            # A speed option: the dynamic module serves these shapes.
            notes.append(f"batch {batch}: not specialized ({exc})")
            log.warning("tvm: static module for batch %d dropped: %s", batch, exc)
            continue
        modules.append(
            {
                "file": name,
                "shapes": {k: list(v) for k, v in shapes.items()},
                "specialized": True,
                "batch": batch,
            }
        )
    if verify and modules:
        with step("verifying the static modules against ONNX Runtime CPU"):
            kept = []
            for entry in modules:
                try:
                    verify_static(model, config, [entry], workdir, example)
                except VerificationError as exc:
                    notes.append(f"{entry['file']}: dropped ({exc})")
                    log.warning("tvm: %s dropped: %s", entry["file"], exc)
                    (workdir / entry["file"]).unlink(missing_ok=True)
                    continue
                kept.append(entry)
            modules = kept
    summary = {
        "batch_sizes": [m["batch"] for m in modules],
        "seconds": round(time.perf_counter() - start, 2),
        "notes": notes,
    }
    return modules, summary


def verify_static(
    model: Model,
    config: BuildConfig,
    modules: list[dict[str, Any]],
    workdir: Path,
    example: Mapping[str, Any],
) -> None:
    """Static modules answer the shapes verify_engine may not reach: check each here, on
    random inputs of its shapes, and record its largest absolute error in its entry.

    Raises:
        VerificationError: a module disagrees with ONNX Runtime past the build's tolerance.
    """
    import tvm
    from tvm import relax

    from enginekit.model import random_feeds, reference_session
    from enginekit.verify import compare_outputs

    session = reference_session(model)
    names = [o.name for o in model.outputs]
    atol, rtol = config.tolerance
    for i, entry in enumerate(modules):
        shapes = {k: tuple(v) for k, v in entry["shapes"].items()}
        feeds = random_feeds(model.inputs, shapes, seed=config.seed + 100 + i) | dict(example)
        ref = dict(zip(names, session.run(names, feeds)))
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(workdir / entry["file"])), tvm.cpu())
        args = [tvm.runtime.tensor(feeds[s.name]) for s in model.inputs if s.name not in example]
        out = vm["main"](*args)
        # As the engine reads them (runtime.py): one tensor, a Shape (tuple) or an int is one
        # output; an Array holds several.
        single = hasattr(out, "__dlpack__") or isinstance(out, (tuple, int))
        values = [out] if single else list(out)
        got = {
            n: v.numpy() if hasattr(v, "numpy") else np.asarray(v, dtype=np.int64)
            for n, v in zip(names, values)
        }
        report = compare_outputs(got, ref, atol, rtol)
        entry["verify_max_abs"] = max((r.get("max_abs", 0.0) for r in report.values()), default=0)
        if not all(r["passed"] for r in report.values()):
            kind = "static" if entry.get("specialized") else "tuned"
            raise VerificationError(
                f"the {kind} module {entry['file']} disagrees with ONNX Runtime past "
                f"atol={atol}, rtol={rtol}: {report}",
                {"passed": False, "cases": [{"shapes": entry["shapes"], "outputs": report}]},
            )
