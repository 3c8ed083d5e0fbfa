"""``infer_dataset``: rows from a source through an engine into committed shards, pipelined.

This module checks the arguments, prepares (or resumes) the output and its ledger, chooses the
batch size and summarizes; :mod:`enginekit.dataset.pipeline` runs the reader, engine and writer
stages (or writes what Ray computed).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset import ledger as ledger_mod
from enginekit.dataset.autobatch import BatchChoice, choose_batch_size, parse_memory
from enginekit.dataset.batches import concat
from enginekit.dataset.images import ImagePreprocess
from enginekit.dataset.pipeline import StageTimes, State, run_local, write_all
from enginekit.dataset.progress import Progress
from enginekit.dataset.resolve import open_source
from enginekit.dataset.sinks import check_format, remove_outputs
from enginekit.dataset.sources import IterableSource, Source
from enginekit.dataset.streams import (
    StreamChoice,
    check_streams,
    choose_streams,
    threads_per_stream,
)
from enginekit.engine import Engine
from enginekit.errors import DatasetError, UsageError

#: Rows per shard when not given: a crash loses at most this much work.
DEFAULT_SHARD_ROWS = 16384


@dataclasses.dataclass(frozen=True)
class InferSummary:
    """What a dataset job did (``to_json`` for ``--json``)."""

    output: str
    format: str
    source: str
    rows: int  # rows in the output (committed)
    rows_inferred: int  # rows run through the engine by this call
    rows_skipped: int  # rows found committed by an earlier run and not redone
    shards: int
    shards_written: int
    shards_skipped: int
    batch_size: int
    batch_choice: BatchChoice | None
    oom_retries: int
    seconds: float
    rows_per_s: float
    resumed: bool
    ray: str | None = None
    stages: StageTimes = dataclasses.field(default_factory=StageTimes)
    streams: int = 1  # engine calls in flight
    threads: int | None = None  # threads per call set at load (None: the artifact's own)
    stream_choice: StreamChoice | None = None

    @property
    def bottleneck(self) -> str:
        """The stage that limited this run (see :class:`StageTimes`)."""
        return self.stages.bottleneck

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["batch_choice"] = self.batch_choice.to_json() if self.batch_choice else None
        out["stream_choice"] = self.stream_choice.to_json() if self.stream_choice else None
        out["stages"] = self.stages.to_json()
        out["bottleneck"] = self.bottleneck
        return out


def sample_rows(source: Source, rows: int) -> dict[str, np.ndarray]:
    """Up to ``rows`` rows from the source's start (an iterable source replays them later)."""
    if isinstance(source, IterableSource):
        pieces = source.peek(rows)
    else:
        pieces = []
        got = 0
        for p in source.pieces(0, rows):
            pieces.append(p)
            got += p.rows
            if got >= rows:
                break
    if not pieces:
        return {}
    p = concat(pieces) if len(pieces) > 1 else pieces[0]
    return {k: np.ascontiguousarray(v[:rows]) for k, v in p.inputs.items()}


def _prepare_output(output: Path, resume: bool, overwrite: bool) -> ledger_mod.Ledger | None:
    if resume and overwrite:
        raise UsageError("resume and overwrite cannot be used together: pick one")
    if output.exists() and not output.is_dir():
        raise DatasetError(f"output {output} is a file; the output is a folder of shards")
    if not output.exists() or not any(output.iterdir()):
        return None
    if overwrite:
        remove_outputs(output, ledger_mod.NAME)
        return None
    found = ledger_mod.Ledger.read(output)
    if not resume:
        what = "a previous run's shards" if found else "files"
        raise DatasetError(
            f"output {output} already holds {what}; pass resume=True (--resume) to continue "
            "that run, overwrite=True (--overwrite) to start again, or pick a new output folder"
        )
    if found is None:
        raise DatasetError(
            f"output {output} has files but no ledger ({ledger_mod.NAME}): nothing to resume; "
            "pass --overwrite if it is yours to replace, or pick a new output folder"
        )
    # Temporaries of writes a crash interrupted: never committed, never read.
    for p in output.iterdir():
        if p.name.startswith((".part-", f".{ledger_mod.NAME}.tmp-")):
            p.unlink()
    return found


def infer_dataset(
    engine_or_artifact: Engine | str | os.PathLike,
    source: Any,
    output: str | os.PathLike,
    batch_size: int | str = "auto",
    *,
    columns: Mapping[str, str] | None = None,
    keep: Sequence[str] | None = None,
    preprocess: ImagePreprocess | None = None,
    format: str = "parquet",
    tensor_format: str = "list",
    shard_rows: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    max_memory: int | str | None = None,
    prefetch: int = 4,
    decode_workers: int | None = None,
    decode_processes: bool = False,
    cast: bool = False,
    progress: bool | None = None,
    ray: str | bool | None = None,
    device: str | None = None,
    streams: int | str = "auto",
    threads: int | None = None,
) -> InferSummary:
    """Run every row of ``source`` through an engine and write the outputs as shards to ``output``.

    Args:
        engine_or_artifact: an Engine, or an artifact path (loaded here, and closed afterwards).
        source: a Parquet file or folder, a ``.npy``/``.npz`` file or folder, a folder of images,
            or an iterable of batches (dicts name -> rows, arrays, or sequences in input order).
        output: a folder: ``part-NNNNN.parquet`` (or ``.npz``) shards and a ledger.
        batch_size: rows per engine call, or ``"auto"`` to measure and choose (see
            :func:`enginekit.dataset.autobatch.choose_batch_size`).
        columns: engine input -> source column (or ``.npz`` key), where the names differ.
        keep: source columns carried into the output (default: every scalar or string column
            that is not an input; sources without ids get a ``row`` column).
        preprocess: how image files become rows (default: resize to the input's H and W).
        format: ``"parquet"`` or ``"npz"``.
        tensor_format: outputs with a shape per row as ``"list"`` (fixed-size lists) or
            ``"tensor"`` (Arrow's fixed-shape tensor extension type); Parquet only.
        shard_rows: rows per shard (default 16384, rounded up to a whole number of batches):
            the unit of commit, and what a crash can lose.
        resume: continue an interrupted run into ``output`` (committed shards are skipped; the
            model, source and settings must be the same, else DatasetError says which changed).
        overwrite: replace what an earlier run wrote in ``output``.
        max_memory: memory budget for the batches in flight (``"4GiB"``, bytes); bounds the
            automatic batch size.
        prefetch: batches read ahead of the engine (and written behind it).
        decode_workers: image decoding workers (default: up to 4; 0 decodes in the reader
            thread).
        decode_processes: decode images in worker processes instead of threads (for heavy
            decoders on many cores; each process takes a second or more to start).
        cast: convert numeric columns to the input dtypes instead of refusing them.
        progress: a progress bar (default: only when stderr is a terminal).
        ray: run the engine on a Ray cluster (True: local or ``RAY_ADDRESS``; or an address)
            through :func:`enginekit.dataset.ray.map_engine`; Parquet sources only.
        device: load the artifact on this device instead of its own.
        streams: engine calls in flight at once, or ``"auto"``: one call at a time on the
            engine as built against one call per core, measured on rows of the source (see
            :func:`enginekit.dataset.streams.choose_streams`); recorded in the summary.
        threads: threads per engine call, set when the artifact is loaded (``ek.load(path,
            threads=...)``); default: the artifact's own with one stream, the cores split
            evenly between streams otherwise. Needs an artifact path, not an Engine.

    Returns:
        an :class:`InferSummary`.

    Raises:
        DatasetError: an unreadable source, a column or dtype or shape that does not fit, an
            output that exists without resume/overwrite, a resume with another model or source.
    """
    from enginekit.backends import load

    check_format(format, tensor_format)
    if not (isinstance(prefetch, int) and prefetch >= 1):
        raise UsageError(f"prefetch must be an integer >= 1, got {prefetch!r}")
    if not (batch_size == "auto" or (isinstance(batch_size, int) and batch_size >= 1)):
        raise UsageError(f"batch_size must be an integer >= 1 or 'auto', got {batch_size!r}")
    if shard_rows is not None and not (isinstance(shard_rows, int) and shard_rows >= 1):
        raise UsageError(f"shard_rows must be an integer >= 1, got {shard_rows!r}")
    check_streams(streams)
    if threads is not None and isinstance(engine_or_artifact, Engine):
        raise UsageError(
            "threads is set when infer_dataset loads the artifact: pass the artifact's path, "
            "or load it yourself with ek.load(path, threads=...)"
        )
    budget = parse_memory(max_memory)
    out = Path(output)
    previous = _prepare_output(out, resume, overwrite)
    owned = not isinstance(engine_or_artifact, Engine)
    if previous is not None and previous.engine:
        # A resume runs the engine as the interrupted run did (see Ledger.engine).
        streams = int(previous.engine.get("streams", 1)) if streams == "auto" else streams
        threads = threads if threads is not None or not owned else previous.engine.get("threads")
    if owned and threads is None and isinstance(streams, int) and streams > 1:
        threads = threads_per_stream(streams)
    reload: Callable[[int], Engine] | None = None
    if isinstance(engine_or_artifact, Engine):
        engine = engine_or_artifact
    else:
        path = engine_or_artifact
        engine = _load(path, device, threads)
        if "threads" not in engine.load_options:
            threads = None  # the backend cannot set threads at load: the artifact's own
        kind = str(device or engine.manifest.get("config", {}).get("device", "cpu"))
        # Threads per call are a CPU matter; a second session on a GPU would only double its
        # memory.
        if kind.startswith("cpu") and _honours_threads(engine):
            reload = lambda t: load(path, device=device, threads=t)  # noqa: E731
    try:
        src = open_source(
            source, engine.inputs, columns=columns, keep=keep, preprocess=preprocess,
            decode_workers=decode_workers, decode_processes=decode_processes, cast=cast,
        )  # fmt: skip
        try:
            return _run(
                engine, engine_or_artifact, src, out, previous, batch_size, format, tensor_format,
                shard_rows, budget, prefetch, progress, ray, keep, streams, threads, reload,
            )  # fmt: skip
        finally:
            src.close()
    finally:
        if owned:
            engine.close()


def _load(path: Any, device: str | None, threads: int | None) -> Engine:
    """The artifact loaded with ``threads`` per call where its backend can set that."""
    from enginekit.backends import load

    if threads is None:
        return load(path, device=device)
    try:
        return load(path, device=device, threads=threads)
    except UsageError:
        return load(path, device=device)  # not a load option of this backend


def _honours_threads(engine: Engine) -> bool:
    from enginekit import backends

    name = engine.manifest.get("backend", {}).get("name")
    try:
        return "threads" in getattr(backends.get(str(name)), "LOAD_OPTIONS", {})
    except Exception:
        return False


def _run(
    engine: Engine,
    given: Any,
    src: Source,
    out: Path,
    previous: ledger_mod.Ledger | None,
    batch_size: int | str,
    fmt: str,
    tensor_format: str,
    shard_rows: int | None,
    budget: int | None,
    prefetch: int,
    progress: bool | None,
    ray: str | bool | None,
    keep: Sequence[str] | None,
    streams: int | str = 1,
    threads: int | None = None,
    reload: Any = None,
) -> InferSummary:
    start_time = time.perf_counter()
    model = ledger_mod.model_checksum(engine.manifest)
    settings = {
        "format": fmt,
        "tensor_format": tensor_format,
        "outputs": [o.name for o in engine.outputs],
        "keep": list(keep) if keep is not None else None,
    }
    choice: BatchChoice | None = None
    sample: dict[str, np.ndarray] = {}
    if previous is not None:
        previous.check(model, src.fingerprint, settings)
        size, rows_per_shard = previous.batch_size, previous.shard_rows
        if batch_size != "auto" and batch_size != size:
            raise DatasetError(
                f"cannot resume into {out} with batch size {batch_size}: the run used "
                f"{size} (outputs must not depend on where a crash fell) — drop the batch size "
                "to reuse it"
            )
        led = previous
    else:
        if batch_size == "auto":
            sample = sample_rows(src, 64)
            choice = choose_batch_size(engine, sample, budget) if sample else None
            size = choice.batch_size if choice else 1
        else:
            size = int(batch_size)
        rows_per_shard = shard_rows or max(size, math.ceil(DEFAULT_SHARD_ROWS / size) * size)
        out.mkdir(parents=True, exist_ok=True)
        led = ledger_mod.Ledger(
            out / ledger_mod.NAME, model, src.fingerprint, src.description, size,
            rows_per_shard, settings,
        )  # fmt: skip
        # Saved once, with how the engine runs, by the writer thread before its first shard:
        # the fsync overlaps the first read (a crash before then leaves an empty folder,
        # which a rerun starts afresh).
    skipped_shards = len(led.shards)
    start = led.committed_rows()
    if start % rows_per_shard and not led.complete:
        led.finish()  # only the source's last shard is short: everything was committed
    if led.complete:
        return _summary(
            out, fmt, src, led, 0, start, skipped_shards, size, choice, State(), start_time,
            previous, ray,
        )  # fmt: skip
    stream_choice: StreamChoice | None = None
    alternate: Engine | None = None
    if ray:
        streams, threads = 1, None
    elif streams == "auto":
        # Sampled only to measure: an iterable source keeps what it peeks until replayed.
        sample = sample or (sample_rows(src, 64) if reload is not None else {})
        stream_choice, alternate = choose_streams(engine, sample, size, reload)
        streams = stream_choice.streams
        threads = stream_choice.threads if alternate is not None else threads
    n_streams = int(streams)
    unsaved = previous is None
    if not ray and led.engine != {"streams": n_streams, "threads": threads}:
        led.engine = {"streams": n_streams, "threads": threads}
        unsaved = True
    bar = Progress(src.rows, start, progress)
    state = State()
    try:
        if ray:
            from enginekit.dataset.ray_job import ray_batches

            results = ray_batches(given, src, start, size, rows_per_shard, ray, engine.outputs)
            inferred = write_all(
                results, led, out, fmt, tensor_format, bar, state, prefetch, src.rows, unsaved
            )
        else:
            inferred = run_local(
                alternate or engine, src, led, out, fmt, tensor_format, size, rows_per_shard,
                start, prefetch, bar, state, n_streams, src.rows, unsaved,
            )  # fmt: skip
    finally:
        bar.close()
        if alternate is not None:
            alternate.close()
    if not led.complete:  # the writer marks it in the last commit when the rows are known
        led.finish()
    summary = _summary(
        out, fmt, src, led, inferred, start, skipped_shards, size, choice, state, start_time,
        previous, ray,
    )  # fmt: skip
    return dataclasses.replace(
        summary, streams=n_streams, threads=threads, stream_choice=stream_choice
    )


def _summary(
    out: Path, fmt: str, src: Source, led: ledger_mod.Ledger, inferred: int, skipped: int,
    skipped_shards: int, size: int, choice: BatchChoice | None, state: State, start_time: float,
    previous: Any, ray: Any,
) -> InferSummary:  # fmt: skip
    seconds = time.perf_counter() - start_time
    return InferSummary(
        output=str(out),
        format=fmt,
        source=src.description,
        rows=led.committed_rows(),
        rows_inferred=inferred,
        rows_skipped=skipped,
        shards=len(led.shards),
        shards_written=len(led.shards) - skipped_shards,
        shards_skipped=skipped_shards,
        batch_size=size,
        batch_choice=choice,
        oom_retries=state.oom,
        seconds=seconds,
        rows_per_s=inferred / seconds if seconds > 0 else 0.0,
        resumed=previous is not None,
        ray=None if not ray else (ray if isinstance(ray, str) else "local"),
        stages=state.stage_times(remote=bool(ray)),
    )
