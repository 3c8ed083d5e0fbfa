"""Scale-out on Ray Data: ``ek.ray.map_engine(dataset, artifact)`` maps a Ray Dataset through an
engine with ``map_batches`` and a callable class, so each actor loads the artifact once.

The artifact travels through Ray's object store (an ``.ekit`` file's bytes, ``ray.put`` once) or,
on a shared file system, as a path; either way each actor checks its SHA-256 before loading it.

What Ray guarantees, and what it does not (Ray 2.60, Ray Data's actor pools): Ray Data starts its
map actors with ``max_restarts=-1`` and ``max_task_retries=-1`` unless told otherwise, so when
an actor process dies its in-flight batches are submitted again (to the restarted actor or
another), and the output blocks of the failed attempt are never part of the dataset: in the
*resulting dataset* every row appears exactly once. With ``compute="tasks"`` its map tasks
(and those of ``infer_dataset(ray=...)``, :mod:`enginekit.dataset.ray_job`) have ``max_retries=-1``: a task whose worker
process dies runs again elsewhere, with the same guarantee. The engine call itself is at-least-once — a
batch may run twice — which is harmless for a pure function such as ``Engine.infer`` but not for
side effects inside the UDF. The driver is not fault tolerant: if it dies, the job is lost; Ray
has no resume across driver restarts. ``infer_dataset(..., ray=...)`` (``enginekit infer
--ray``) adds that: the driver writes Ray's results into the same ledgered shards as a local run,
so a rerun after a crash resumes from the last committed shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray

from enginekit.dataset.columns import check_rows
from enginekit.dataset.parquet import ParquetSource
from enginekit.errors import ArtifactError, UsageError


def _sha256(path: Path) -> str:
    if path.is_dir():
        path = path / "manifest.json"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class EngineActor:
    """The callable class of ``map_batches``: loads the artifact once, then maps batches."""

    def __init__(
        self,
        blob: list[Any] | None,
        path: str,
        sha256: str,
        columns: Mapping[str, str],
        keep_inputs: bool,
        cast: bool,
        device: str | None,
        engine_batch_size: int | None = None,
        threads: int | None = None,
        auto_threads: bool = False,
    ) -> None:
        self.engine_batch_size = engine_batch_size
        if blob is not None:
            # The ObjectRef travels inside a list: Ray passes it through unresolved, and this
            # actor fetches the bytes from the object store (once per actor).
            data = ray.get(blob[0])
            got = hashlib.sha256(data).hexdigest()
            if got != sha256:
                raise ArtifactError(
                    f"artifact {path} reached this Ray worker with SHA-256 {got[:12]}, expected "
                    f"{sha256[:12]}: corrupted in transit; rerun the job"
                )
            self._dir = tempfile.TemporaryDirectory(prefix="enginekit-ray-")
            local = Path(self._dir.name) / Path(path).name
            local.write_bytes(data)
        else:
            local = Path(path)
            if not local.exists():
                raise ArtifactError(
                    f"artifact {path} is not visible on this Ray node; put it on a shared file "
                    "system or ship it through the object store (ship='bytes', an .ekit file)"
                )
            got = _sha256(local)
            if got != sha256:
                raise ArtifactError(
                    f"artifact {path} on this Ray node has SHA-256 {got[:12]}, the driver's "
                    f"{sha256[:12]}: the nodes see different files; sync them or ship bytes"
                )
        self.engine = _load(local, device, threads, auto_threads)
        self.columns = {s.name: columns.get(s.name, s.name) for s in self.engine.inputs}
        self.keep_inputs = keep_inputs
        self.cast = cast

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        """One batch: a dict of numpy arrays (``batch_format="numpy"``) or a pyarrow Table."""
        columns = _columns(batch)
        feeds = {}
        for spec in self.engine.inputs:
            col = self.columns[spec.name]
            if col not in columns:
                raise UsageError(
                    f"Ray batch has no column {col!r} for engine input {spec.name!r}; columns "
                    f"are {', '.join(map(repr, columns))} — map it with columns={{...}}"
                )
            feeds[spec.name] = check_rows(spec, columns[col](), f"column {col!r}", self.cast)
        outputs = self._infer(feeds)
        used = set(self.columns.values())
        result = {k: get() for k, get in columns.items() if self.keep_inputs or k not in used}
        result.update(outputs)
        return result

    def _infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The engine over a Ray batch, ``engine_batch_size`` rows per call (a large Ray batch
        pays Ray's per-batch costs once for several engine calls)."""
        n = len(next(iter(feeds.values())))
        step = self.engine_batch_size or n
        if step >= n:
            return self.engine.infer(feeds)
        parts = [
            self.engine.infer({k: v[i : i + step] for k, v in feeds.items()})
            for i in range(0, n, step)
        ]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# compute="tasks": one EngineActor per worker process, kept between tasks. Ray keeps a job's
# worker processes and reuses them for its later tasks, also those of the next dataset the same
# driver runs; so only the first task in a process pays for the imports and the artifact, where
# an actor pool starts new processes (imports, fetch, checksum, load) for every dataset.
_CACHED: dict[str, EngineActor] = {}


def map_block(batch: Any, ctor_args: tuple[Any, ...]) -> dict[str, np.ndarray]:
    """The function of ``map_engine(..., compute="tasks")``: the batch through this process's
    cached engine, loaded (fetched and checksum-verified, as an actor does) on first use."""
    return cached_mapper(ctor_args)(batch)


def cached_mapper(ctor_args: tuple[Any, ...]) -> EngineActor:
    """This worker process's :class:`EngineActor` for ``ctor_args``: made on first use and
    kept (one per process: another artifact or setting replaces it)."""
    key = repr(ctor_args[1:])  # the artifact's path and checksum, and how it is run
    mapper = _CACHED.get(key)
    if mapper is None:
        for old in _CACHED.values():
            old.engine.close()
        _CACHED.clear()
        mapper = _CACHED[key] = EngineActor(*ctor_args)
    return mapper


def _load(path: Path, device: str | None, threads: int | None, auto: bool) -> Any:
    """The artifact loaded with ``threads`` per engine call (``ek.load(threads=)``); where they
    were chosen for the user (``auto``) and the backend cannot set them, with its own."""
    from enginekit.backends import load

    if threads is None:
        return load(path, device=device)
    try:
        return load(path, device=device, threads=threads)
    except UsageError:
        if not auto:
            raise
        return load(path, device=device)


def _dense(a: np.ndarray) -> np.ndarray:
    """Lists (nested, as Ray's numpy format gives them: arrays of arrays) as one array."""
    if a.dtype != object or not len(a) or isinstance(a[0], str):
        return a
    return np.stack([_dense(np.asarray(e)) for e in a])


def _columns(batch: Any) -> dict[str, Any]:
    """name -> a function giving the column as numpy rows (zero-copy where Arrow allows)."""
    from enginekit.dataset.columns import to_numpy

    if isinstance(batch, Mapping):
        return {k: (lambda v=v: _dense(np.asarray(v))) for k, v in batch.items()}

    def getter(name: str) -> Any:
        return lambda: to_numpy(batch.column(name), f"column {name!r}")

    return {name: getter(name) for name in batch.column_names}


def map_engine(
    dataset: Any,
    artifact: str | os.PathLike,
    *,
    batch_size: int | str | None = "auto",
    batch_format: str = "numpy",
    columns: Mapping[str, str] | None = None,
    keep_inputs: bool = False,
    concurrency: int | tuple[int, int] = 1,
    num_cpus: float = 1,
    num_gpus: float | None = None,
    ship: str = "auto",
    cast: bool = False,
    device: str | None = None,
    max_memory: int | str | None = None,
    engine_batch_size: int | None = None,
    threads: int | str | None = "auto",
    compute: str = "actors",
    **map_batches_args: Any,
) -> Any:
    """``dataset.map_batches`` through the engine of ``artifact``; returns the Ray Dataset with
    the output columns added (input columns dropped unless ``keep_inputs``).

    Args:
        dataset: a ``ray.data.Dataset``.
        artifact: an ``.ekit`` file or artifact folder.
        batch_size: rows per engine call; ``"auto"`` measures on the driver
            (:func:`enginekit.dataset.autobatch.choose_batch_size` on the dataset's first rows);
            ``None``: each block as it comes (what a read fused into the actors needs: there,
            a batch size counts the read's input rows).
        batch_format: ``"numpy"`` (zero-copy for Ray's tensor columns) or ``"pyarrow"``
            (zero-copy for fixed-size list columns, as Parquet stores tensors).
        columns: engine input -> dataset column, where the names differ.
        concurrency: actors in the pool (an int, or ``(min, max)`` for an autoscaling pool).
        num_cpus, num_gpus: resources reserved per actor.
        ship: ``"bytes"`` (through the object store; ``.ekit`` files), ``"path"`` (a shared file
            system), or ``"auto"`` (bytes for an ``.ekit`` file, the path for a folder).
        max_memory: the budget for ``"auto"``.
        engine_batch_size: rows per engine call inside each Ray batch (default: the whole
            batch). A Ray batch several engine batches long pays Ray's per-batch costs (the
            call into the actor, turning its outputs into a block) once for all of them.
        compute: ``"actors"`` (a pool of ``concurrency`` actors, each loading the artifact
            once; Ray Data starts them for every dataset it runs) or ``"tasks"`` (Ray tasks,
            at most ``concurrency`` at once, in worker processes Ray keeps and reuses, each
            loading the artifact once and keeping it: a driver that runs several datasets pays
            the processes' start once, not per dataset).
        map_batches_args: passed on to ``map_batches`` (e.g. ``max_restarts``).
    """
    auto_threads = threads == "auto"
    if auto_threads:
        threads = max(1, int(num_cpus)) if not num_gpus else None
    if threads is not None and not (
        isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1
    ):
        raise UsageError(
            f"threads {threads!r}: expected an integer >= 1 (threads per engine call in each "
            "actor), 'auto' (the actor's num_cpus) or None (the artifact's own)"
        )
    if compute not in ("actors", "tasks"):
        raise UsageError(f"compute {compute!r}: expected 'actors' or 'tasks'")
    path = Path(artifact)
    if not path.exists():
        raise ArtifactError(f"artifact {path}: no such file or folder")
    if ship == "auto":
        ship = "path" if path.is_dir() else "bytes"
    if ship not in ("bytes", "path"):
        raise UsageError(f"ship {ship!r}: expected 'bytes', 'path' or 'auto'")
    if ship == "bytes" and path.is_dir():
        raise UsageError(f"ship='bytes' needs an .ekit file; {path} is a folder (use ship='path')")
    if batch_size == "auto":
        batch_size = _auto_batch(dataset, path, columns or {}, max_memory, cast, device)
    args = actor_args(path, ship, columns, keep_inputs, cast, device, engine_batch_size,
                      threads, auto_threads)  # fmt: skip
    common = dict(batch_size=batch_size, batch_format=batch_format, zero_copy_batch=True,
                  num_cpus=num_cpus, num_gpus=num_gpus, **map_batches_args)  # fmt: skip
    if compute == "tasks":
        size = concurrency if isinstance(concurrency, int) else concurrency[1]
        return dataset.map_batches(
            map_block, fn_kwargs={"ctor_args": args},
            compute=ray.data.TaskPoolStrategy(size=size), **common,
        )  # fmt: skip
    pool = (
        ray.data.ActorPoolStrategy(size=concurrency)
        if isinstance(concurrency, int)
        else ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    )
    return dataset.map_batches(EngineActor, fn_constructor_args=args, compute=pool, **common)


def actor_args(
    path: Path, ship: str, columns: Mapping[str, str] | None, keep_inputs: bool, cast: bool,
    device: str | None, engine_batch_size: int | None, threads: int | None, auto_threads: bool,
) -> tuple[Any, ...]:  # fmt: skip
    """:class:`EngineActor`'s arguments: the artifact (an ``.ekit`` file's bytes put in the
    object store once, or its path) with its checksum, and how to run it."""
    sha = _sha256(path)
    blob = [ray.put(path.read_bytes())] if ship == "bytes" else None
    return (blob, str(path.resolve()), sha, dict(columns or {}), keep_inputs, cast, device,
            engine_batch_size, threads, auto_threads)  # fmt: skip


def _auto_batch(
    dataset: Any,
    path: Path,
    columns: Mapping[str, str],
    max_memory: Any,
    cast: bool,
    device: str | None,
) -> int:
    from enginekit.backends import load
    from enginekit.dataset.autobatch import choose_batch_size, parse_memory

    with load(path, device=device) as engine:
        batch = dataset.take_batch(64, batch_format="numpy")
        sample = {}
        for spec in engine.inputs:
            a = _dense(np.asarray(batch[columns.get(spec.name, spec.name)]))
            sample[spec.name] = check_rows(spec, np.ascontiguousarray(a), spec.name, cast)
        return choose_batch_size(engine, sample, parse_memory(max_memory)).batch_size


def read_dataset(
    src: ParquetSource, start: int, size: int = 1, num_cpus: float = 1, block_rows: int = 1,
    concurrency: int | None = None, blocks: int | None = None,
) -> Any:  # fmt: skip
    """A Ray Dataset of the source's rows from ``start`` on, one block per read task, each
    about a row group long (or several, up to the first group end at least ``block_rows``
    rows on) and cut where a local run's engine batches of ``size`` rows are cut (so that the
    engine sees the same batches); a resumed run reads nothing it does not need. With
    ``blocks``, ``block_rows`` is ignored: that many blocks (fewer if there are not that
    many row group ends), each ending at the group end nearest an equal share of the rows.

    The read tasks reserve ``num_cpus``: the same as the engine actors' makes Ray Data fuse
    them into the actors (each actor reads its rows itself, and they never pass through the
    object store). In front of ``map_engine(compute="tasks", concurrency=N)`` pass
    ``concurrency=N`` too: Ray Data fuses two task operators only when their task pools have
    the same size, and unfused every block of inputs is written to the object store by one
    task and read back by another (Ray 2.60; 100k rows of the demo CNN on 2 CPUs: 1.2 GB
    through the object store, two tasks per block). (Reading row groups ourselves also steps around ray.data.read_parquet's
    threaded file listing, which races importing fsspec's HTTP filesystem when aiohttp is not
    installed.)"""
    parts = [{"pieces": json.dumps(p)} for p in block_pieces(src, start, size, block_rows, blocks)]
    needed = list(dict.fromkeys([*src.mapping.values(), *src.keep]))
    pool = None if concurrency is None else ray.data.TaskPoolStrategy(size=concurrency)
    return ray.data.from_items(parts, override_num_blocks=max(1, len(parts))).map_batches(
        read_row_groups, batch_size=1, batch_format="pyarrow", fn_kwargs={"columns": needed},
        num_cpus=num_cpus, compute=pool,
    )  # fmt: skip


def block_pieces(
    src: ParquetSource, start: int, size: int, block_rows: int = 1, blocks: int | None = None,
    shrink: tuple[int, int, int] | None = None,
) -> list[list[tuple[str, int, int, int]]]:  # fmt: skip
    """The blocks of :func:`read_dataset`, each as its pieces: (file, row group, first row in
    the group, rows). ``shrink=(shares, least, most)``: blocks that shrink towards the end,
    each ending at the first cut at least ``rows left / shares`` rows on (but ``least`` to
    ``most`` rows), so that workers taking blocks as they go end close together."""
    groups, row = [], 0  # (file, group, first row, rows)
    for f, counts in zip(src.files, src._meta):
        for g, n in enumerate(counts):
            if n and row + n > start:
                groups.append((str(f), g, row, n))
            row += n
    # Block ends: each row group's end rounded up to the engine batches' grid (from start).
    ends = sorted({min(row, start + -(-(r + n - start) // size) * size) for _, _, r, n in groups})
    merged: list[int] = []
    if shrink is not None and ends:
        shares, least, most = shrink
        lo = start
        for end in ends:
            want = min(most, max(least, -(-(ends[-1] - lo) // shares)))
            if end == ends[-1] or end - lo >= want:
                merged.append(end)
                lo = end
    elif blocks is not None and ends:
        total = ends[-1] - start
        for k in range(1, blocks):
            near = min(ends, key=lambda e: abs(e - start - k * total / blocks))
            if near < ends[-1] and (not merged or near > merged[-1]):
                merged.append(near)
        merged.append(ends[-1])
    else:
        for end in ends:
            if end == ends[-1] or end - (merged[-1] if merged else start) >= block_rows:
                merged.append(end)
    ends = merged
    parts, lo = [], start
    for hi in ends:
        parts.append([
            (f, g, max(lo - r, 0), min(hi, r + n) - max(lo, r))
            for f, g, r, n in groups
            if r < hi and r + n > lo
        ])  # fmt: skip
        lo = hi
    return parts


def read_row_groups(batch: Any, columns: list[str] | None = None) -> Any:
    """A Ray read task: each item's pieces (JSON: file, row group, first row, rows) as one
    table, tensor columns by the page reader into one buffer each (as in a local run)."""
    from enginekit.dataset.parquet import read_groups

    pieces = [tuple(p) for item in batch.column("pieces").to_pylist() for p in json.loads(item)]
    if columns is None:
        import pyarrow.parquet as pq

        columns = list(pq.ParquetFile(pieces[0][0]).schema_arrow.names)
    return read_groups(pieces, columns)
