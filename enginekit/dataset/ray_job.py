"""``infer_dataset(..., ray=...)`` (``enginekit infer --ray``): the engine runs on a Ray cluster
through Ray Data, and the driver writes Ray's results, in order, into the same ledgered shards as
a local run (:func:`enginekit.dataset.pipeline.write_all`), so that a rerun after a crash resumes
from the last committed shard.

The job's layout, for Ray's way of sharing CPUs (see docs/batch-inference.md, "Scaling out on
Ray Data", for what each choice measured): one Ray task per CPU of the cluster, each holding one
CPU and running a one-thread engine that its worker process keeps for later jobs. The rows are
cut (on the driver) into blocks of several row groups, on the engine's batch grid, that shrink
towards the end; each task claims the next free block, reads it itself (the rows never pass
through the object store), infers it and yields its outputs at once, then claims the next, so
that a CPU whose task runs faster takes more blocks and the tasks end together. The driver puts
the outputs back in row order and writes while the tasks go on.

Exactly once: a task whose worker process dies runs again (Ray Data's ``max_retries=-1``), and
Ray's streaming generators keep the outputs the driver already took and drop the retry's copies
of them: the retry yields the blocks its task claimed before, in the same order (claims are
keys in Ray's key-value store, in row order), before it claims more.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from enginekit.dataset.batches import Batch, rebatch
from enginekit.dataset.parquet import ParquetSource
from enginekit.dataset.ray import actor_args, block_pieces, cached_mapper
from enginekit.dataset.sources import Piece, Source
from enginekit.errors import DatasetError, UsageError

#: The most input bytes --ray puts in one block (Ray Data's own target block size).
#: Measured on the demo CNN (12 KB a row, 100k rows, 2 CPUs, loaded host), when each block was
#: a task: blocks of 4096 rows 8,600-10,100 rows/s and 9.4-11.1 CPU-s; of 11-12.5k rows (this
#: cap: 10.9k, rounded up to a row group's end) 9,600-12,600 and 7.5-9.6. A 384 MiB cap (4
#: blocks, not 10) measured worse: 11.4k vs 12.5k rows/s, 9.7 vs 8.8 CPU-s (load 5-6).
BLOCK_BYTES = 128 << 20

#: The smallest block, as a part of the largest: the tasks claim blocks as they go, so a CPU
#: whose task runs faster takes more of them, and the blocks shrink towards the end (each
#: the rows left over the CPUs) so that the last one, what a CPU may still run alone, is short.
LAST_BLOCK_PARTS = 8

#: Bytes of a kept id column's value, for the output block size (ids are mostly int64).
ID_BYTES = 8


def ray_batches(
    artifact: Any, src: Source, start: int, size: int, shard_rows: int, address: str | bool,
    outputs: Sequence[Any] = (),
) -> Iterator[Any]:  # fmt: skip
    """For ``infer_dataset(ray=...)``: the source's rows from ``start`` through Ray, in order, as
    (batch, outputs) pairs cut at the shard boundaries the local writer expects. ``outputs``:
    the engine's output specs (they size the blocks the tasks hand back)."""
    if not isinstance(src, ParquetSource):
        raise UsageError(
            f"--ray reads Parquet sources (Ray reads them in parallel); {src.description} is not "
            "one — run it locally, or convert it to Parquet"
        )
    if not isinstance(artifact, (str, os.PathLike)):
        raise UsageError("--ray ships an artifact to the workers: pass its path, not an Engine")
    started = False
    if not ray.is_initialized():
        if isinstance(address, str):
            ray.init(address=address)
        else:
            ray.init(include_dashboard=False)
        started = True
    ctx = ray.data.DataContext.get_current()
    # Ray Data reserves part of the cluster's CPUs for each operator, and with one map
    # operator and one task per CPU that held the second task back: sampled on 2 CPUs, two
    # tasks ran 36% of a job's time with the reservation and 76% without it.
    saved = (
        ctx.op_resource_reservation_enabled, ctx.target_max_block_size,
        ctx.execution_options.preserve_order,
    )  # fmt: skip
    job = f"enginekit/{uuid.uuid4().hex}"
    try:
        # The tasks claim blocks as they go, so their outputs arrive out of row order: the
        # driver puts them back in order (each output carries its rows' numbers).
        ctx.execution_options.preserve_order = False
        ctx.op_resource_reservation_enabled = False
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        most = max(size, BLOCK_BYTES // max(1, _row_bytes(src.inputs)))
        left = (src.rows or 0) - start
        least = max(size, most // LAST_BLOCK_PARTS)
        blocks = block_pieces(src, start, size, shrink=(cpus, least, most))
        if outputs:
            # The outputs of a full-size block are one Ray block: Ray Data gathers a task's
            # outputs until they pass this size (else all of a task's, till its end) and
            # slices those 1.5x past it; the smaller last blocks' outputs go out together.
            # 0.9 of the largest block's: Ray counts some bytes a row more than the arrays
            # (the demo CNN's 48 as 56), and cuts fall on row group ends.
            out_row = _row_bytes(outputs) + ID_BYTES * (len(src.keep) + 1)
            largest = max(sum(p[3] for p in b) for b in blocks)
            ctx.target_max_block_size = max(1, int(0.9 * out_row * min(largest, most)))
        path = Path(artifact)
        args = actor_args(
            path, "path" if path.is_dir() else "bytes", src.mapping, False, False, None, size,
            1, True,
        )  # fmt: skip
        needed = list(dict.fromkeys([*src.mapping.values(), *src.keep]))
        tasks = min(cpus, len(blocks))
        firsts, row = [], start
        for block in blocks:
            firsts.append(row)
            row += sum(p[3] for p in block)
        plan = json.dumps({"job": job, "blocks": blocks, "firsts": firsts})
        work: Any = ray.data.from_items(
            [{"task": i} for i in range(tasks)], override_num_blocks=tasks
        )
        mapped = work.map_batches(
            read_and_map, batch_size=1, batch_format="pyarrow", zero_copy_batch=True,
            fn_kwargs={"ctor_args": args, "columns": needed, "plan": plan}, num_cpus=1,
            compute=ray.data.TaskPoolStrategy(size=tasks),
        )  # fmt: skip
        names = src.keep or []

        def pieces() -> Iterator[Piece]:
            at, waiting = start, {}
            for b in mapped.iter_batches(batch_size=None, batch_format="numpy"):
                for first, part in _runs(b):
                    waiting[first] = part
                while at in waiting:
                    part = waiting.pop(at)
                    n = len(part[ROW])
                    outs = {k: v for k, v in part.items() if k not in names and k != ROW}
                    yield Piece(_ids(part, names, at, n), outs, n)
                    at += n
            if waiting or at != start + left:
                raise DatasetError(
                    f"Ray returned rows {start}-{at} of {start}-{start + left} in order and "
                    f"{len(waiting)} run(s) of rows past a gap: a block was lost; rerun with "
                    "resume to go on from the last shard written"
                )

        for batch in rebatch(pieces(), size, shard_rows, start):
            assert isinstance(batch, Batch)
            yield batch, batch.piece.inputs
    finally:
        (
            ctx.op_resource_reservation_enabled, ctx.target_max_block_size,
            ctx.execution_options.preserve_order,
        ) = saved  # fmt: skip
        _forget(job)
        if started:
            ray.shutdown()


#: The column of row numbers a task adds to its outputs (the driver puts blocks in order).
ROW = "__enginekit_row"


def _runs(batch: dict[str, np.ndarray]) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """A Ray output batch as runs of consecutive rows (Ray may join two blocks of a task)."""
    rows = batch[ROW]
    cuts = [0, *(np.flatnonzero(np.diff(rows) != 1) + 1).tolist(), len(rows)]
    for lo, hi in itertools.pairwise(cuts):
        if hi > lo:
            yield int(rows[lo]), {k: v[lo:hi] for k, v in batch.items()}


def read_and_map(
    batch: Any, ctor_args: tuple[Any, ...], columns: list[str], plan: str
) -> Iterator[dict[str, np.ndarray]]:
    """A ``--ray`` task: claims the job's blocks (``plan``, JSON: each a list of pieces, see
    :func:`enginekit.dataset.ray.block_pieces`) one at a time, first come first served, and
    reads and infers each in this process's kept engine, yielding its outputs at once.

    A task claims blocks in row order, each before it reads it: a retry of the task (its
    process died) finds the blocks it claimed and yields them again, in the same order,
    before it claims more, so that Ray's streaming generator can drop the copies of outputs
    the driver already took."""
    from enginekit.dataset.parquet import read_groups

    job = json.loads(plan)
    mapper = cached_mapper(ctor_args)
    for task in batch.column("task").to_pylist():
        for b in _claims(job["job"], task, len(job["blocks"])):
            table = read_groups([tuple(p) for p in job["blocks"][b]], columns)
            out = mapper(table)
            # The read buffer goes back to the next block's read (parquet.spare_buffer) only
            # once nothing refers to it.
            del table
            first = job["firsts"][b]
            out[ROW] = np.arange(first, first + len(next(iter(out.values()))), dtype=np.int64)
            yield out


def _claims(job: str, task: int, blocks: int) -> Iterator[int]:
    """The blocks task ``task`` of ``job`` runs, in row order: each that it claims first (a
    put into Ray's key-value store that fails when the key exists) or that it claimed in an
    earlier attempt (the key holds its number)."""
    from ray.experimental import internal_kv as kv

    me = str(task).encode()
    for b in range(blocks):
        taken = kv._internal_kv_put(f"{job}/{b}", me, overwrite=False)
        if not taken or kv._internal_kv_get(f"{job}/{b}") == me:
            yield b


def _forget(job: str) -> None:
    """Drop a job's claims from Ray's key-value store (a driver killed before this leaves a
    few bytes a block there, till the cluster stops)."""
    from ray.experimental import internal_kv as kv

    kv._internal_kv_del(f"{job}/", del_by_prefix=True)


def _row_bytes(specs: Sequence[Any]) -> int:
    """Bytes of one row of these tensors (symbolic dims past the batch count as 1)."""
    total = 0
    for spec in specs:
        dims = [d for d in spec.shape[1:] if isinstance(d, int)]
        total += np.dtype(spec.dtype).itemsize * int(np.prod(dims, dtype=np.int64))
    return total


def _ids(batch: dict[str, np.ndarray], names: list[str], at: int, n: int) -> dict[str, Any]:
    import pyarrow as pa

    if not names:
        return {"row": pa.array(np.arange(at, at + n, dtype=np.int64))}
    return {k: pa.array(batch[k]) for k in names}
