"""``infer_dataset(..., ray=...)`` (``enginekit infer --ray``): the engine runs on a Ray cluster
through Ray Data, and the driver writes Ray's results, in order, into the same ledgered shards as
a local run (:func:`enginekit.dataset.pipeline.write_all`), so that a rerun after a crash resumes
from the last committed shard.

The job's layout, for Ray's way of sharing CPUs (see docs/batch-inference.md, "Scaling out on
Ray Data", for what each choice measured): one Ray task per CPU of the cluster, each holding one
CPU and running a one-thread engine that its worker process keeps for later jobs; each task
reads its own rows (they never pass through the object store) as blocks of several row groups
cut on the engine's batch grid, and yields each block's outputs as soon as they are inferred,
so that the driver writes while the tasks go on.

Exactly once: a task whose worker process dies runs again (Ray Data's ``max_retries=-1``), and
Ray's streaming generators keep the outputs the driver already took and drop the retry's copies
of them (the task yields the same blocks in the same order every time: they are cut on the
driver).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from enginekit.dataset.batches import Batch, rebatch
from enginekit.dataset.parquet import ParquetSource
from enginekit.dataset.ray import actor_args, block_pieces, cached_mapper
from enginekit.dataset.sources import Piece, Source
from enginekit.errors import UsageError

#: The most input bytes --ray puts in one block (Ray Data's own target block size).
#: Measured on the demo CNN (12 KB a row, 100k rows, 2 CPUs, loaded host), when each block was
#: a task: blocks of 4096 rows 8,600-10,100 rows/s and 9.4-11.1 CPU-s; of 11-12.5k rows (this
#: cap: 10.9k, rounded up to a row group's end) 9,600-12,600 and 7.5-9.6. A 384 MiB cap (4
#: blocks, not 10) measured worse: 11.4k vs 12.5k rows/s, 9.7 vs 8.8 CPU-s (load 5-6).
BLOCK_BYTES = 128 << 20

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
    saved = (ctx.op_resource_reservation_enabled, ctx.target_max_block_size)
    try:
        ctx.execution_options.preserve_order = True
        ctx.op_resource_reservation_enabled = False
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        most = BLOCK_BYTES // max(1, _row_bytes(src.inputs))
        left = (src.rows or 0) - start
        block = max(size, min(left // (4 * cpus), most))
        # Blocks of equal rows, as many as make a whole number of them per CPU.
        count = -(-max(1, -(-left // block)) // cpus) * cpus
        blocks = block_pieces(src, start, size, blocks=count)
        # One task per CPU, each a run of consecutive blocks. Ray Data's loop notices a finished
        # task up to 0.1 s late (its ray.wait on the running tasks times out every 0.1 s), and
        # its CPU sat idle meanwhile, once per block when each block was a task; a task's
        # blocks go out as they are done, so the driver still writes while the tasks run.
        tasks = [blocks[i * len(blocks) // cpus : (i + 1) * len(blocks) // cpus] for i in range(cpus)]  # fmt: skip
        tasks = [t for t in tasks if t]
        if outputs:
            # Each block's outputs are one Ray block: Ray Data gathers a task's outputs until
            # they pass this size (else all of a task's, till its end) and slices those 1.5x
            # past it. 0.9 of a mean block's: Ray counts some bytes a row more than the arrays
            # (the demo CNN's 48 as 56), and blocks differ by up to ~10% in rows.
            out_row = _row_bytes(outputs) + ID_BYTES * len(src.keep)
            ctx.target_max_block_size = max(1, int(0.9 * out_row * left / max(1, len(blocks))))
        path = Path(artifact)
        args = actor_args(
            path, "path" if path.is_dir() else "bytes", src.mapping, False, False, None, size,
            1, True,
        )  # fmt: skip
        needed = list(dict.fromkeys([*src.mapping.values(), *src.keep]))
        items = [{"blocks": json.dumps(t)} for t in tasks]
        work: Any = ray.data.from_items(items, override_num_blocks=len(items))
        mapped = work.map_batches(
            read_and_map, batch_size=1, batch_format="pyarrow", zero_copy_batch=True,
            fn_kwargs={"ctor_args": args, "columns": needed}, num_cpus=1,
            compute=ray.data.TaskPoolStrategy(size=cpus),
        )  # fmt: skip
        names = src.keep or []

        def pieces() -> Iterator[Piece]:
            at = start
            for b in mapped.iter_batches(batch_size=None, batch_format="numpy"):
                n = len(next(iter(b.values())))
                outs = {k: v for k, v in b.items() if k not in names}
                yield Piece(_ids(b, names, at, n), outs, n)
                at += n

        for batch in rebatch(pieces(), size, shard_rows, start):
            assert isinstance(batch, Batch)
            yield batch, batch.piece.inputs
    finally:
        ctx.op_resource_reservation_enabled, ctx.target_max_block_size = saved
        if started:
            ray.shutdown()


def read_and_map(
    batch: Any, ctor_args: tuple[Any, ...], columns: list[str]
) -> Iterator[dict[str, np.ndarray]]:
    """A ``--ray`` task: each item's blocks (JSON: a list of blocks, each a list of pieces, see
    :func:`enginekit.dataset.ray.block_pieces`) read and inferred in turn, in this process's
    kept engine, each block's outputs yielded as soon as they are inferred."""
    from enginekit.dataset.parquet import read_groups

    mapper = cached_mapper(ctor_args)
    for item in batch.column("blocks").to_pylist():
        for pieces in json.loads(item):
            table = read_groups([tuple(p) for p in pieces], columns)
            out = mapper(table)
            # The read buffer goes back to the next block's read (parquet.spare_buffer) only
            # once nothing refers to it.
            del table
            yield out


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
