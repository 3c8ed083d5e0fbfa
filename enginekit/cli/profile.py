"""``enginekit profile``: per-op/per-kernel times of an engine artifact from its backend's
profiler, each op's share and achieved GFLOP/s against this host's float32 matmul peak."""

from __future__ import annotations

import argparse
from typing import Any

from enginekit.cli.common import (
    EXIT_OK,
    add_inputs,
    add_json_report,
    load_inputs,
    report,
)
from enginekit.errors import UsageError


def add(sub: Any) -> None:
    """Register ``enginekit profile``."""
    p = sub.add_parser(
        "profile",
        help="per-op time table of an engine (the backend's profiler), with GFLOP/s vs peak",
        description="Runs one batch with the backend's own profiler (ONNX Runtime's, "
        "OpenVINO's performance counters, TVM's Relax VM instrument, the JAX profiler for "
        "XLA) and prints the slowest ops, each op's share of "
        "the time, and the GFLOP/s of matrix products and convolutions against a float32 "
        "matmul peak measured in the same run.",
    )
    p.add_argument("artifact", help="engine artifact (.ekit file or directory)")
    p.add_argument("--batch", type=int, default=None, help="batch size of random inputs "
                   "(default: the profile's opt shape)")  # fmt: skip
    add_inputs(p, "profile on these inputs instead of random ones")
    p.add_argument("--runs", type=int, default=10, help="recorded runs (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="unrecorded runs first (default 3)")
    p.add_argument("--top", type=int, default=15, help="ops listed (default 15)")
    p.add_argument(
        "--trace", metavar="OUT.json", help="also write a Chrome trace (chrome://tracing, Perfetto)"
    )
    add_json_report(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile the artifact and print (or write) the table."""
    from enginekit.evaluate.profile import profile

    if args.batch is not None and args.input:
        raise UsageError("give --batch (random inputs) or --input, not both")
    if args.top < 1:
        raise UsageError(f"--top {args.top}: expected at least 1")
    feeds = load_inputs(args.input) if args.input else None
    result = profile(args.artifact, batch=args.batch, feeds=feeds, runs=args.runs,
                     warmup=args.warmup)  # fmt: skip
    text = result.table(args.top)
    if args.trace:
        written = result.write_trace(args.trace)
        text += f"\ntrace written to {written}"
    report(args, result.to_json(), text)
    return EXIT_OK
