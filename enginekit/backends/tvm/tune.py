"""Optional MetaSchedule tuning of static-batch modules, with a database users keep.

Candidates are built and measured in this process, one after another (see
:func:`_in_process_builder`), not in MetaSchedule's worker pools: each pool worker imports
``tvm.s_tir.tensor_intrin``, whose ~500 TVMScript functions each call ``inspect.stack()``;
with PyTorch imported (``tvm_ffi`` imports it whenever it is installed) that took minutes
per worker here, and the 300 s builder timeout then failed every candidate.

The database directory holds MetaSchedule's JSON database (``database_workload.json``,
``database_tuning_record.json``), its logs, and ``enginekit-ledger.json``: for each task
(kernel workload x target) the per-task trial budget it was already given. A build skips the
tasks whose recorded budget covers the one it asks for, so a second build with the same
database, model and budget runs no trials; a larger budget tunes again, starting from the
records already there.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import linecache
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from enginekit.errors import BuildError

log = logging.getLogger(__name__)

LEDGER = "enginekit-ledger.json"
#: Per-kernel trials from which the evolutionary search (cost model) replaces random sampling.
_EVOLVE_FROM = 16
_KEYS = {"trials", "batch_sizes", "method", "seconds", "serve", "margin"}
#: Tuners: enginekit's own (its schedule's alternatives timed in the model, :mod:`.inmodel`)
#: and MetaSchedule's search; the first is the default.
METHODS = ("enginekit", "metaschedule")


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    """What to tune: ``trials`` per static batch size, for each of ``batch_sizes``, by
    ``method`` (one of :data:`METHODS`), within ``seconds`` per batch size (enginekit's tuner
    only; None: no limit)."""

    trials: int
    batch_sizes: tuple[int, ...]
    method: str = METHODS[0]
    seconds: float | None = None
    #: "auto": a tuned module serves its batch only when timed faster than the dynamic module
    #: by ``margin`` (:mod:`.gate`); "always": served untimed.
    serve: str = "auto"
    margin: float = 0.02


def parse_tune(value: Any, default_batch: int) -> TuneSpec | None:
    """The ``tune`` option as a TuneSpec (None or trials 0: no tuning).

    Accepted: ``{"trials": 256, "batch_sizes": [1, 8], "method": "enginekit", "seconds":
    1200, "serve": "auto", "margin": 0.02}``, or a bare int of trials at ``default_batch``.

    Raises:
        BuildError: unknown keys, method or serve, a non-positive budget or batch size, a
            margin outside [0, 1).
    """
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, Mapping)):
        raise BuildError(
            f"tune={value!r}: expected a dict like {{'trials': 64, 'batch_sizes': [1, 8]}}"
        )
    spec = {"trials": value} if isinstance(value, int) else dict(value)
    unknown = set(spec) - _KEYS
    if unknown:
        raise BuildError(
            f"tune has unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_KEYS))}"
        )
    trials = spec.get("trials")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
        raise BuildError(f"tune trials={trials!r}: expected a whole number >= 0")
    if trials == 0:
        return None
    sizes = spec.get("batch_sizes", [default_batch])
    if isinstance(sizes, int):
        sizes = [sizes]
    if not sizes or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes
    ):
        raise BuildError(f"tune batch_sizes={sizes!r}: expected positive whole numbers")
    method = spec.get("method", METHODS[0])
    if method not in METHODS:
        raise BuildError(f"tune method={method!r}: expected one of {', '.join(METHODS)}")
    seconds = spec.get("seconds")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0
    ):
        raise BuildError(f"tune seconds={seconds!r}: expected a positive number of seconds")
    from enginekit.backends.tvm.gate import MARGIN, SERVE

    serve = spec.get("serve", SERVE[0])
    if serve not in SERVE:
        raise BuildError(f"tune serve={serve!r}: expected one of {', '.join(SERVE)}")
    margin = spec.get("margin", MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise BuildError(
            f"tune margin={margin!r}: expected a fraction in [0, 1) such as 0.02 (2% faster)"
        )
    return TuneSpec(
        trials=trials,
        batch_sizes=tuple(sorted(set(sizes))),
        method=method,
        seconds=None if seconds is None else float(seconds),
        serve=serve,
        margin=float(margin),
    )


def require_tuning_deps() -> None:
    """MetaSchedule needs xgboost (its cost model) and psutil.

    Raises:
        BuildError: naming what is missing and the extra that installs it.
    """
    missing = []
    for name in ("xgboost", "psutil"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BuildError(
            f"tuning needs {', '.join(missing)}, which is not installed: "
            "pip install 'enginekit[tvm-tune]' (or drop the tune option)"
        )


def read_db_file(path: Path, key: str, what: str, again: str) -> dict[str, Any] | None:
    """A JSON file of a tuning database (a dict with a dict under ``key``), or None when it
    does not exist; a BuildError naming ``what`` it should be and how to start ``again``."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError(f"{path}: unreadable {what} ({exc}); delete it to {again}") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), dict):
        raise BuildError(f"{path}: not enginekit's {what}; delete it to {again}")
    return data


def write_db_file(path: Path, data: Mapping[str, Any]) -> None:
    """Replace a tuning database's JSON file at once (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _ledger(db_dir: Path) -> dict[str, Any]:
    data = read_db_file(db_dir / LEDGER, "tasks", "tuning ledger", "re-tune with this database")
    return data if data is not None else {"version": 1, "tasks": {}}


def _save_ledger(db_dir: Path, ledger: Mapping[str, Any]) -> None:
    write_db_file(db_dir / LEDGER, ledger)


def _task_key(task: Any, target: Any) -> str:
    import tvm_ffi

    shash = int(tvm_ffi.structural_hash(task.dispatched[0]))
    return f"{shash & 0xFFFFFFFFFFFFFFFF:016x}:{json.dumps(dict(target.export()), sort_keys=True, default=str)}"


def _fast_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack`` without its per-frame scan of ``sys.modules`` (what TVMScript's
    parser needs from it: frames, file names, line numbers, the source line)."""
    frame: Any = sys._getframe(1)
    out = []
    while frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno)
        source = [line] if line else None
        index = 0 if line else None
        info = inspect.FrameInfo(
            frame, code.co_filename, frame.f_lineno, code.co_name, source, index
        )
        out.append(info)
        frame = frame.f_back
    return out


def import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (MetaSchedule needs it) in seconds, not minutes.

    ``inspect.stack`` is swapped for :func:`_fast_stack` during this one import only.
    """
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.stack
    inspect.stack = _fast_stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = original


def _in_process_builder() -> Any:
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build, default_export

    @derived_object
    class InProcessBuilder(ms.builder.PyBuilder):
        def build(self, build_inputs: list[Any]) -> list[Any]:
            results = []
            for item in build_inputs:
                try:
                    path = default_export(default_build(item.mod, item.target, None))
                    results.append(ms.builder.BuilderResult(path, None))
                except Exception as exc:  # a candidate that does not compile: MS skips it
                    results.append(ms.builder.BuilderResult(None, f"{type(exc).__name__}: {exc}"))
            return results

    return InProcessBuilder()


def _in_process_runner(config: Any) -> Any:
    import tvm
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner.local_runner import (
        default_alloc_argument,
        default_run_evaluator,
    )

    @derived_object
    class Done(ms.runner.PyRunnerFuture):
        def __init__(self, result: Any) -> None:
            super().__init__()
            self._result = result

        def done(self) -> bool:
            return True

        def result(self) -> Any:
            return self._result

    @derived_object
    class InProcessRunner(ms.runner.PyRunner):
        def run(self, runner_inputs: list[Any]) -> list[Any]:
            futures = []
            for item in runner_inputs:
                try:
                    module = tvm.runtime.load_module(item.artifact_path)
                    device = tvm.runtime.device(item.device_type, 0)
                    args = default_alloc_argument(device, [a.as_json() for a in item.args_info], 1)
                    costs = default_run_evaluator(module, device, config, args)
                    result = ms.runner.RunnerResult([float(c) for c in costs], None)
                except Exception as exc:
                    result = ms.runner.RunnerResult(None, f"{type(exc).__name__}: {exc}")
                futures.append(Done(result))
            return futures

    return InProcessRunner()


def _commit_default_schedules(tasks: list[Any], target: Any, database: Any, config: Any) -> int:
    """Measure enginekit's default schedule of each task and commit it as a tuning record.

    MetaSchedule then picks a sampled candidate only where it beats the default, so a small
    budget never makes a kernel slower than the untuned build. Returns the records committed.
    """
    from tvm.s_tir import meta_schedule as ms

    from enginekit.backends.tvm.schedule import schedule_cpu
    from enginekit.backends.tvm.simd import vector_lanes

    lanes = vector_lanes(target)
    builder, runner = _in_process_builder(), _in_process_runner(config)
    committed = 0
    for task in tasks:
        mod = task.dispatched[0]
        try:
            sch = schedule_cpu(mod["main"], lanes)
        except Exception:  # the rule does not apply: MetaSchedule's candidates only
            continue
        if sch is None or not hasattr(sch, "trace"):  # no trace: nothing to record
            continue
        built = builder.build([ms.builder.BuilderInput(sch.mod, target)])[0]
        if built.error_msg:
            continue
        args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        measured = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", args_info)])
        result = measured[0].result()
        if result.error_msg or not result.run_secs:
            continue
        database.commit_tuning_record(
            ms.database.TuningRecord(
                sch.trace, database.commit_workload(mod), result.run_secs, target, args_info
            )
        )
        committed += 1
    return committed


def open_database(db_dir: Path) -> Any:
    """MetaSchedule's JSON database in ``db_dir`` (created if missing)."""
    from tvm.s_tir import meta_schedule as ms

    db_dir.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(
        path_workload=str(db_dir / "database_workload.json"),
        path_tuning_record=str(db_dir / "database_tuning_record.json"),
        allow_missing=True,
    )


def tune(mod: Any, target: Any, spec: TuneSpec, db_dir: Path, label: str) -> dict[str, Any]:
    """Tune the kernels of ``mod`` (a fused, static-shape module) into the database.

    Returns:
        facts for the manifest: tasks, tasks tuned now / found in the database, trials run,
        seconds.
    """
    from tvm.s_tir import meta_schedule as ms

    require_tuning_deps()
    start = time.perf_counter()
    import_tensor_intrinsics()
    database = open_database(db_dir)
    tasks = [
        t
        for t in ms.relax_integration.extract_tasks(mod, target)
        if not (t.mod.attrs and t.mod.attrs.get("tirx.is_scheduled", False))
    ]
    if not tasks:
        return {"tasks": 0, "tuned_now": 0, "from_database": 0, "trials_run": 0, "seconds": 0.0}
    share = max(1, math.ceil(spec.trials / len(tasks)))
    ledger = _ledger(db_dir)
    keys = [_task_key(t, target) for t in tasks]
    todo = [
        (t, k)
        for t, k in zip(tasks, keys)
        if int(ledger["tasks"].get(k, {}).get("trials", 0)) < share
        or not database.has_workload(t.dispatched[0])
    ]
    before = len(database.get_all_tuning_records())
    defaults = 0
    if todo:
        log.info(
            "%s: tuning %d of %d kernels, %d trials each (%d kernels already in %s)",
            label, len(todo), len(tasks), share, len(tasks) - len(todo), db_dir,
        )  # fmt: skip
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            [t for t, _ in todo],
            work_dir=str(db_dir),
            num_threads=os.cpu_count() or 1,
            seed=0,
            # Evolutionary search evolves 512 candidates per round with its cost model (~20 s a
            # round per kernel here): worth it for real budgets, not for a handful of trials.
            strategy="evolutionary" if share >= _EVOLVE_FROM else "replay-trace",
        )
        config = ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=40, enable_cpu_cache_flush=False
        )
        defaults = _commit_default_schedules([t for t, _ in todo], target, database, config)
        ms.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(db_dir),
            max_trials_global=share * len(todo),
            max_trials_per_task=share,
            num_trials_per_iter=min(64, share),
            builder=_in_process_builder(),
            runner=_in_process_runner(config),
            database=database,
        )
        for task, key in todo:
            ledger["tasks"][key] = {"trials": share, "name": task.task_name}
        _save_ledger(db_dir, ledger)
    else:
        log.info("%s: all %d kernels already tuned in %s; no trials", label, len(tasks), db_dir)
    return {
        "tasks": len(tasks),
        "tuned_now": len(todo),
        "from_database": len(tasks) - len(todo),
        "trials_per_task": share,
        "trials_run": len(database.get_all_tuning_records()) - before - defaults,
        "default_schedules_measured": defaults,
        "seconds": round(time.perf_counter() - start, 2),
    }
