"""``enginekit calibrate``: per-tensor INT8 ranges of a float model on data, and what each backend
consumes of them (Q/DQ model, TensorRT cache, ONNX Runtime's TensorRT EP table)."""

from __future__ import annotations

import argparse
from typing import Any

from enginekit.cli.common import EXIT_OK, emit


def add(sub: Any) -> None:
    """Register ``enginekit calibrate``."""
    p = sub.add_parser(
        "calibrate", help="calibrate a float ONNX model on data: per-tensor INT8 ranges (CPU)"
    )
    p.add_argument("model", help="float ONNX model")
    p.add_argument(
        "--data", required=True, help=".npz (one key per input), .npy, or a folder of them"
    )
    p.add_argument("--method", default="entropy", choices=["entropy", "percentile", "minmax"])
    p.add_argument("--percentile", type=float, default=99.99, help="for --method percentile")
    p.add_argument("--batch-size", type=int, default=32, help="rows per calibration batch")
    p.add_argument("--max-samples", type=int, help="stop after this many samples")
    p.add_argument("-o", "--output", required=True, help="calibration table (.json)")
    p.add_argument("--qdq", metavar="FILE.onnx", help="also write the Q/DQ model")
    p.add_argument(
        "--qdq-style", default="tensorrt", choices=["tensorrt", "onnxruntime-cpu"],
        help="Q/DQ layout (default tensorrt: int8, zero points 0, float biases)",
    )  # fmt: skip
    p.add_argument("--trt-cache", metavar="FILE", help="also write a TensorRT calibration cache")
    p.add_argument("--trt-version", default="10.0.0", help="TensorRT version for the cache header")
    p.add_argument("--ort-trt-table", metavar="DIR", help="also write ORT's TensorRT EP table")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Calibrate, save the table, write what was asked for, print where."""
    from enginekit.calibration import calibrate, writers

    table = calibrate(
        args.model, args.data, args.method, percentile=args.percentile,
        batch_size=args.batch_size, max_samples=args.max_samples,
    )  # fmt: skip
    written = {"table": str(table.save(args.output))}
    if args.qdq:
        writers.write_qdq(args.model, table, args.qdq, style=args.qdq_style)
        written["qdq"] = args.qdq
    if args.trt_cache:
        written["trt_cache"] = str(writers.write_trt_cache(table, args.trt_cache, args.trt_version))
    if args.ort_trt_table:
        files = writers.write_ort_trt_table(table, args.ort_trt_table)
        written["ort_trt_table"] = str(files["flatbuffers"])
    info = {**table.manifest_entry(), "written": written}
    text = (
        f"calibrated {args.model}: {table.method}, {table.samples} samples in {table.batches} "
        f"batches, {len(table)} tensors\n" + "\n".join(f"wrote {v}" for v in written.values())
    )
    emit(args, info, text)
    return EXIT_OK
