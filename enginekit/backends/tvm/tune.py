"""Optional MetaSchedule tuning of static-batch modules, with a database users keep.

The database directory holds MetaSchedule's JSON database (``database_workload.json``,
``database_tuning_record.json``), its logs, and ``enginekit-ledger.json``: for each task
(kernel workload x target) the per-task trial budget it was already given. A build skips the
tasks whose recorded budget covers the one it asks for, so a second build with the same
database, model and budget runs no trials; a larger budget tunes again, starting from the
records already there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from enginekit.errors import BuildError

log = logging.getLogger(__name__)

LEDGER = "enginekit-ledger.json"
_KEYS = {"trials", "batch_sizes", "builder_timeout", "runner_timeout"}


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    """What to tune: ``trials`` per static batch size, for each of ``batch_sizes``."""

    trials: int
    batch_sizes: tuple[int, ...]
    builder_timeout: float = 300.0
    runner_timeout: float = 60.0


def parse_tune(value: Any, default_batch: int) -> TuneSpec | None:
    """The ``tune`` option as a TuneSpec (None or trials 0: no tuning).

    Accepted: ``{"trials": 256, "batch_sizes": [1, 8]}`` (``builder_timeout``,
    ``runner_timeout`` in seconds optional), or a bare int of trials at ``default_batch``.

    Raises:
        BuildError: unknown keys, a non-positive budget or batch size.
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
    return TuneSpec(
        trials=trials,
        batch_sizes=tuple(sorted(set(sizes))),
        builder_timeout=float(spec.get("builder_timeout", 300.0)),
        runner_timeout=float(spec.get("runner_timeout", 60.0)),
    )


def require_tuning_deps() -> None:
    """MetaSchedule's cost model needs xgboost and its runner psutil.

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


def _ledger(db_dir: Path) -> dict[str, Any]:
    path = db_dir / LEDGER
    if not path.is_file():
        return {"version": 1, "tasks": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError(
            f"{path}: unreadable tuning ledger ({exc}); delete it to re-tune with this database"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
        raise BuildError(f"{path}: not an enginekit tuning ledger; delete it to re-tune")
    return data


def _save_ledger(db_dir: Path, ledger: Mapping[str, Any]) -> None:
    tmp = db_dir / f".{LEDGER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, db_dir / LEDGER)


def _task_key(task: Any, target: Any) -> str:
    import tvm

    shash = tvm.ir.structural_hash(task.dispatched[0])
    return f"{shash & 0xFFFFFFFFFFFFFFFF:016x}:{json.dumps(dict(target.export()), sort_keys=True, default=str)}"


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
    if todo:
        log.info(
            "%s: tuning %d of %d kernels, %d trials each (%d kernels already in %s)",
            label, len(todo), len(tasks), share, len(tasks) - len(todo), db_dir,
        )  # fmt: skip
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            [t for t, _ in todo], work_dir=str(db_dir), num_threads=os.cpu_count() or 1, seed=0
        )
        cores = os.cpu_count() or 1
        ms.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(db_dir),
            max_trials_global=share * len(todo),
            max_trials_per_task=share,
            num_trials_per_iter=min(64, share),
            builder=ms.builder.LocalBuilder(max_workers=cores, timeout_sec=spec.builder_timeout),
            runner=ms.runner.LocalRunner(
                timeout_sec=spec.runner_timeout,
                evaluator_config=ms.runner.EvaluatorConfig(
                    number=3, repeat=1, min_repeat_ms=40, enable_cpu_cache_flush=False
                ),
            ),
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
        "trials_run": len(database.get_all_tuning_records()) - before,
        "seconds": round(time.perf_counter() - start, 2),
    }
