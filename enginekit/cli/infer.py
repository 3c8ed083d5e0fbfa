"""``enginekit infer``: a dataset through an engine artifact into resumable output shards."""

from __future__ import annotations

import argparse
from typing import Any

from enginekit.cli.common import EXIT_OK, add_json_report, names, report
from enginekit.errors import UsageError


def add(sub: Any) -> None:
    """Register ``enginekit infer``."""
    p = sub.add_parser(
        "infer",
        help="run a dataset (Parquet, .npy/.npz, image folder) through an engine into shards",
        description="Run every row of SOURCE through the engine and write the outputs as "
        "Parquet (or .npz) shards to OUTPUT, reading, inferring and writing in parallel; "
        "a killed run continues with --resume.",
    )
    p.add_argument("artifact", help="engine artifact (.ekit file or folder)")
    p.add_argument(
        "source", help="Parquet file or folder, .npy/.npz file or folder, or a folder of images"
    )
    p.add_argument("-o", "--output", required=True, help="output folder (shards and a ledger)")
    p.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="INPUT=COLUMN",
        help="feed engine input INPUT from source column (or .npz key) COLUMN; repeatable",
    )
    p.add_argument("--keep", metavar="COLS", help="source columns carried into the output (a,b)")
    p.add_argument("--format", choices=["parquet", "npz"], default="parquet", help="shard format")
    p.add_argument(
        "--tensor-format",
        choices=["list", "tensor"],
        default="list",
        help="per-row tensors as fixed-size lists or Arrow's tensor extension type",
    )
    p.add_argument(
        "--batch-size", default="auto", help="rows per engine call, or 'auto' (measured)"
    )
    p.add_argument(
        "--max-memory", metavar="SIZE", help="memory budget for batches in flight, e.g. 4GiB"
    )
    p.add_argument(
        "--streams",
        default="auto",
        help="engine calls in flight at once, or 'auto' (default: one call on the engine as "
        "built vs one per core, measured)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="threads per engine call, set at load (default: the artifact's own with one "
        "stream, the cores split between streams otherwise)",
    )
    p.add_argument("--shard-rows", type=int, help="rows per committed shard (default 16384)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted run")
    again.add_argument("--overwrite", action="store_true", help="replace an earlier run's output")
    p.add_argument("--prefetch", type=int, default=4, help="batches read ahead (default 4)")
    p.add_argument("--decode-workers", type=int, help="image decoding threads (default up to 4)")
    p.add_argument(
        "--decode-processes", action="store_true", help="decode images in worker processes"
    )
    p.add_argument("--cast", action="store_true", help="convert numeric columns to input dtypes")
    img = p.add_argument_group("image preprocessing (image folders)")
    img.add_argument("--resize", metavar="N|HxW", help="shorter side to N, or exactly HxW")
    img.add_argument("--crop", metavar="N|HxW", help="center crop")
    img.add_argument("--mean", metavar="A,B,C", help="per-channel mean (after scaling)")
    img.add_argument("--std", metavar="A,B,C", help="per-channel std")
    img.add_argument("--scale", type=float, default=1 / 255, help="pixel scale (default 1/255)")
    img.add_argument("--layout", choices=["NCHW", "NHWC"], default=None, help="default NCHW")
    img.add_argument("--dtype", default=None, help="default: the input's dtype")
    img.add_argument("--mode", default="RGB", help="Pillow mode: RGB, L, RGBA")
    p.add_argument(
        "--ray",
        nargs="?",
        const=True,
        default=None,
        metavar="ADDRESS",
        help="run the engine on Ray Data (a local cluster, or the cluster at ADDRESS)",
    )
    p.add_argument("--device", help="override the artifact's device")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_report(p)
    p.set_defaults(func=cmd_infer)


def _size(text: str | None, flag: str) -> Any:
    if text is None:
        return None
    parts = text.lower().split("x")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected N or HxW, e.g. 256 or 224x224") from None
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return (values[0], values[1])
    raise UsageError(f"{flag} {text!r}: expected N or HxW")


def _floats(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(v) for v in names(text))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected numbers separated by commas") from None


def _preprocess(args: argparse.Namespace, artifact: str) -> Any:
    given = [args.resize, args.crop, args.mean, args.std, args.layout, args.dtype]
    if all(v is None for v in given):
        return None
    from enginekit.dataset import ImagePreprocess

    dtype = args.dtype
    if dtype is None:
        from enginekit.artifact import open_artifact

        inputs = open_artifact(artifact).manifest.get("inputs", [])
        dtype = inputs[0]["dtype"] if inputs else "float32"
    return ImagePreprocess(
        resize=_size(args.resize, "--resize"),
        crop=_size(args.crop, "--crop"),
        mean=_floats(args.mean, "--mean"),
        std=_floats(args.std, "--std"),
        scale=args.scale,
        layout=args.layout or "NCHW",
        dtype=dtype,
        mode=args.mode,
    )


def cmd_infer(args: argparse.Namespace) -> int:
    """Run the dataset; print the summary (as JSON with --json, to a file with --json-file)."""
    from enginekit.dataset import infer_dataset

    columns = {}
    for spec in args.column:
        key, sep, value = spec.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"--column {spec!r}: expected INPUT=COLUMN")
        columns[key] = value
    batch = _count_or_auto("--batch-size", args.batch_size)
    streams = _count_or_auto("--streams", args.streams)
    summary = infer_dataset(
        args.artifact,
        args.source,
        args.output,
        batch,
        columns=columns or None,
        keep=names(args.keep) if args.keep is not None else None,
        preprocess=_preprocess(args, args.artifact),
        format=args.format,
        tensor_format=args.tensor_format,
        shard_rows=args.shard_rows,
        resume=args.resume,
        overwrite=args.overwrite,
        max_memory=args.max_memory,
        prefetch=args.prefetch,
        decode_workers=args.decode_workers,
        decode_processes=args.decode_processes,
        cast=args.cast,
        progress=False if args.no_progress or args.json == "-" else None,
        ray=args.ray,
        device=args.device,
        streams=streams,
        threads=args.threads,
    )
    s = summary
    lines = [
        f"{s.rows} rows in {s.shards} shard(s) at {s.output} ({s.format})",
        f"this run: {s.rows_inferred} rows inferred in {s.seconds:.2f} s "
        f"({s.rows_per_s:,.0f} rows/s), {s.shards_written} shard(s) written"
        + (f", {s.shards_skipped} already committed (resumed)" if s.resumed else ""),
        f"batch size {s.batch_size}"
        + (f": {s.batch_choice.reason}" if s.batch_choice else "")
        + (f"; {s.oom_retries} out-of-memory retries (halved)" if s.oom_retries else ""),
    ]
    if s.ray:
        lines.append(f"engine ran on Ray ({s.ray})")
    else:
        per = f"{s.threads} thread(s) each" if s.threads else "the artifact's threading"
        lines.append(
            f"{s.streams} engine call(s) in flight, {per}"
            + (f": {s.stream_choice.reason}" if s.stream_choice else "")
        )
    if s.rows_inferred:
        lines.append(s.stages.describe())
    report(args, s.to_json(), "\n".join(lines))
    return EXIT_OK


def _count_or_auto(flag: str, value: str) -> int | str:
    """A flag's value: "auto", or an integer (a UsageError naming the flag otherwise)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{flag} {value!r}: expected an integer or 'auto'") from None
