"""The build matrix: one job per entry, skipped where its backend is unavailable, looked up in
the cache, and built (in parallel processes with ``jobs > 1``) where it is a miss.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import inspect
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.errors import BackendUnavailable, BuildError, EnginekitError, VerificationError
from enginekit.pipeline.cache import Cache, entry_key
from enginekit.pipeline.config import CalibrationSpec, Entry, PipelineConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker needs to build one entry (picklable: it crosses into spawned processes)."""

    entry: Entry
    model: str
    output: str
    key: str
    cache: str | None
    build_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one entry.

    Attributes:
        id: the entry id (artifact name without ``.ekit``).
        status: ``built``, ``cached`` (copied from the cache, no backend work), ``skipped``
            (backend unavailable here) or ``failed``.
        reason: why skipped or failed.
        key: the cache key.
        artifact: the artifact written.
        seconds: wall time of this entry's build phase (lookup, build, store, copy).
        failure: ``verification`` (the engine disagrees with the reference) or ``error``.
        verify: the verification report (from the manifest, or from the failed verification).
        manifest: the artifact's manifest (None when none was written).
        pid: the process that built or fetched it.
    """

    id: str
    status: str
    reason: str = ""
    key: str | None = None
    artifact: str | None = None
    seconds: float = 0.0
    failure: str | None = None
    verify: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    pid: int = dataclasses.field(default_factory=os.getpid)
    cache_note: str | None = None  # "corrupt, rebuilt": the cached artifact failed its checksums


# -- calibration arguments -----------------------------------------------------------------------


class FileBatches:
    """Batches read from ``.npy`` (single input) or ``.npz`` (one key per input) files, one file
    per batch, in order; iterable more than once (calibration may take several passes)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.files = tuple(str(f) for f in files)

    def __iter__(self) -> Iterator[Any]:
        for f in self.files:
            if f.endswith(".npz"):
                with np.load(f, allow_pickle=False) as z:
                    yield {k: z[k] for k in z.files}
            else:
                yield np.load(f, allow_pickle=False)

    def __len__(self) -> int:
        return len(self.files)


def _data_arg(files: Sequence[Path], single: bool) -> Any:
    return str(files[0]) if single and len(files) == 1 else FileBatches(files)


def _hash_tree(h: Any, paths: Sequence[Path], root: Path) -> None:
    for p in paths:
        members = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for q in members:
            h.update(os.path.relpath(q, root).encode() + b"\0")
            with open(q, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)


def calibration_digest(spec: CalibrationSpec | None, root: Path) -> str | None:
    """SHA-256 of what int8 calibration reads: data files (or the table) and the method."""
    if spec is None:
        return None
    h = hashlib.sha256(spec.method.encode() + b"\0")
    _hash_tree(h, spec.data, root)
    if spec.table is not None:
        _hash_tree(h, [spec.table], root)
    h.update(b"verify\0")
    _hash_tree(h, spec.verify_data, root)
    return h.hexdigest()


def calibration_kwargs(spec: CalibrationSpec | None) -> dict[str, Any]:
    """``enginekit.build`` keyword arguments of an int8 entry.

    Raises:
        BuildError: this enginekit has no calibration support.
    """
    from enginekit.build import build

    if spec is None:
        return {}
    if "calib_data" not in inspect.signature(build).parameters:
        raise BuildError(
            "int8 entries need enginekit's calibration support (enginekit.calibration), which "
            "this install lacks; upgrade enginekit"
        )
    kwargs: dict[str, Any] = {"calib_method": spec.method}
    if spec.table is not None:
        kwargs["calibration"] = str(spec.table)
    else:
        kwargs["calib_data"] = _data_arg(spec.data, spec.single_source)
    if spec.verify_data:
        kwargs["verify_data"] = _data_arg(spec.verify_data, len(spec.verify_data) == 1)
    return kwargs


# -- planning ------------------------------------------------------------------------------------


def unavailable_reason(backend: str, device: str) -> tuple[str | None, str | None]:
    """(reason the backend cannot build here or None, its version)."""
    from enginekit import backends

    try:
        avail = backends.availability(backend)
    except BackendUnavailable as exc:
        return str(exc), None
    if not avail.available:
        return f"backend {backend!r} is not available here: {avail.reason}", None
    kind = device.split(":")[0]
    if not any(d.split(":")[0] == kind for d in avail.devices):
        return (
            f"backend {backend!r} has no {device!r} device here (it has: "
            f"{', '.join(avail.devices) or 'none'})",
            avail.version,
        )
    return None, avail.version


def plan(
    cfg: PipelineConfig,
    model: Any,
    model_file: Path,
    out_dir: Path,
    cache: Cache | None,
    strict: bool = False,
) -> tuple[list[Job], list[Outcome]]:
    """Jobs for the entries that can build here, and outcomes for those that cannot (skipped,
    or failed with ``strict``)."""
    from enginekit.artifact import build_key

    digest = calibration_digest(cfg.calibration, cfg.root)
    jobs: list[Job] = []
    skipped: list[Outcome] = []
    versions: dict[tuple[str, str], tuple[str | None, str | None]] = {}
    for entry in cfg.entries:
        probe = (entry.backend, entry.config.device)
        if probe not in versions:
            versions[probe] = unavailable_reason(*probe)
        reason, version = versions[probe]
        if reason is not None:
            status = "failed" if strict else "skipped"
            skipped.append(Outcome(entry.id, status, reason, failure="error" if strict else None))
            continue
        int8 = entry.precision == "int8"
        try:
            kwargs = calibration_kwargs(cfg.calibration) if int8 else {}
        except EnginekitError as exc:
            skipped.append(Outcome(entry.id, "failed", str(exc), failure="error"))
            continue
        spine_key = build_key(model, entry.config, version, digest if int8 else None)
        jobs.append(
            Job(
                entry=entry,
                model=str(model_file),
                output=str(out_dir / f"{entry.id}.ekit"),
                key=entry_key(spine_key, {"device": entry.config.device}),
                cache=str(cache.root) if cache is not None else None,
                build_kwargs=kwargs,
            )
        )
    return jobs, skipped


# -- running -------------------------------------------------------------------------------------


def _from_manifest(job: Job, status: str, manifest: dict[str, Any], seconds: float) -> Outcome:
    return Outcome(
        job.entry.id,
        status,
        key=job.key,
        artifact=job.output,
        seconds=seconds,
        verify=manifest.get("verify"),
        manifest=manifest,
    )


def lookup(job: Job) -> Outcome | None:
    """A cache hit copied to the job's output, or None (no cache, or a miss)."""
    return _lookup(job)[0]


def _lookup(job: Job) -> tuple[Outcome | None, bool]:
    """(the hit or None, whether the cached artifact was corrupt and evicted)."""
    if job.cache is None:
        return None, False
    start = time.perf_counter()
    cache = Cache(job.cache)
    with cache.lock(job.key):
        manifest = cache.fetch(job.key, Path(job.output))
    if manifest is None:
        return None, job.key in cache.evicted
    return _from_manifest(job, "cached", manifest, time.perf_counter() - start), False


def build_one(job: Job) -> Outcome:
    """Build one entry (under its cache lock: a job that needs the same key meanwhile waits and
    then gets a hit), store it in the cache, and return what happened. Never raises for a
    failed build: the outcome says why."""
    from enginekit.build import build

    start = time.perf_counter()
    cache = Cache(job.cache) if job.cache is not None else None
    held = cache.lock(job.key) if cache is not None else contextlib.nullcontext(True)
    try:
        with held:
            if cache is not None:
                manifest = cache.fetch(job.key, Path(job.output))
                if manifest is not None:
                    return _from_manifest(job, "cached", manifest, time.perf_counter() - start)
            engine = build(
                job.model, config=job.entry.config, output=job.output, **job.build_kwargs
            )
            manifest = dict(engine.manifest)
            engine.close()
            if cache is not None:
                cache.store(
                    job.key,
                    Path(job.output),
                    {
                        "id": job.entry.id,
                        "backend": job.entry.backend,
                        "precision": job.entry.precision,
                    },
                )
    except VerificationError as exc:
        return Outcome(
            job.entry.id, "failed", str(exc), job.key, seconds=time.perf_counter() - start,
            failure="verification", verify=exc.report or None,
        )  # fmt: skip
    except Exception as exc:  # one entry's failure must not stop the others
        log.debug("entry %s failed", job.entry.id, exc_info=True)
        kind = "" if isinstance(exc, EnginekitError) else " (unexpected; -vv logs the traceback)"
        return Outcome(
            job.entry.id, "failed", f"{type(exc).__name__}: {exc}{kind}", job.key,
            seconds=time.perf_counter() - start, failure="error",
        )  # fmt: skip
    return _from_manifest(job, "built", manifest, time.perf_counter() - start)


def run(jobs: Sequence[Job], parallel: int = 1) -> list[Outcome]:
    """Cache hits first, in this process; then the misses, in ``parallel`` spawned processes
    (in this process when ``parallel`` is 1 or only one entry misses). Outcomes in job order."""
    done: dict[str, Outcome] = {}
    misses = []
    corrupt = set()
    for job in jobs:
        hit, evicted = _lookup(job)
        if hit is not None:
            done[job.entry.id] = hit
        else:
            misses.append(job)
            if evicted:
                corrupt.add(job.entry.id)
    if parallel > 1 and len(misses) > 1:
        context = multiprocessing.get_context("spawn")
        workers = min(parallel, len(misses))
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = {pool.submit(build_one, job): job for job in misses}
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                try:
                    done[job.entry.id] = future.result()
                except Exception as exc:  # the worker died (killed, out of memory)
                    done[job.entry.id] = Outcome(
                        job.entry.id, "failed", f"the build process died: {exc}", job.key,
                        failure="error",
                    )  # fmt: skip
    else:
        for job in misses:
            done[job.entry.id] = build_one(job)
    for name in corrupt:
        if done[name].status == "built":
            done[name] = dataclasses.replace(done[name], cache_note="corrupt, rebuilt")
    return [done[job.entry.id] for job in jobs]
