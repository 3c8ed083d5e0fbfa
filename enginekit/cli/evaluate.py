"""``enginekit compare`` (the same inputs through backends and a reference, every output checked)
and ``enginekit bench`` (latency and throughput per batch size).

In these commands ``--json`` prints the JSON report to stdout (instead of the table) and
``--json-file FILE`` writes it to FILE (the table is still printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from enginekit.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_VERIFY,
    add_candidate,
    add_inputs,
    add_json_report,
    add_shapes,
    ints,
    load_inputs,
    names,
    parse_candidate,
    report,
    shapes,
)
from enginekit.errors import UsageError

# -- compare -------------------------------------------------------------------------------------


def add_compare(sub: Any) -> None:
    """Register ``enginekit compare``."""
    p = sub.add_parser(
        "compare",
        help="run the same inputs through backends and a reference; check every output",
        description="Exit codes: 0 every compared backend passed, 3 one failed or errored "
        "(or was skipped, with --require-all), 1 nothing could be compared, 2 usage.",
    )
    p.add_argument("model", nargs="?", help="ONNX model (optional with --golden and --engine)")
    p.add_argument(
        "--backends", default=None, help="comma-separated backend names (default: all available)"
    )
    add_candidate(p)
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ARTIFACT",
        help="a built engine to compare; repeatable",
    )
    add_shapes(
        p,
        "trtexec syntax: name:AxB or name:min,opt,max (several inputs separated by spaces)",
    )
    add_inputs(p, "inputs to use instead of random ones")
    p.add_argument(
        "--golden", metavar="FILE.npz", help="inputs and reference outputs from a golden file"
    )
    p.add_argument(
        "--save-golden", metavar="FILE.npz", help="write the inputs and reference outputs used here"
    )
    p.add_argument(
        "--reference",
        default=None,
        help="onnxruntime (default: ONNX Runtime CPU FP32) or a backend name",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: the precision's)")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: the precision's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rule",
        default="scaled",
        choices=["scaled", "elementwise"],
        help="scaled (default): error relative to each output's scale max|ref|, plus cosine; "
        "elementwise: atol + rtol*|ref| per element",
    )
    p.add_argument(
        "--equal-nan", action="store_true", help="NaN where the reference has NaN agrees"
    )
    p.add_argument("--topk", type=int, default=5, help="k of top-k agreement (classifier outputs)")
    p.add_argument(
        "--min-cosine", type=float, help="cosine-similarity floor (default: the precision's)"
    )
    p.add_argument("--min-top1", type=float, help="also fail below this top-1 agreement")
    p.add_argument("--require-all", action="store_true", help="a skipped backend fails the gate")
    add_json_report(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """``enginekit compare``: exit 0 passed, 3 failed, 1 nothing compared."""
    from enginekit.evaluate.compare import compare

    if args.golden and args.save_golden:
        raise UsageError("--golden and --save-golden together would only copy the file")
    if args.golden and args.input:
        raise UsageError("--golden holds the inputs; drop --input")
    entries: list[Any] = names(args.backends) if args.backends else []
    entries += [parse_candidate(t) for t in args.candidate]
    entries += list(args.engine)
    if args.model is None and not args.engine:
        raise UsageError("compare needs the ONNX model, or --engine ARTIFACT with --golden FILE")
    result = compare(
        args.model,
        entries or None,
        shapes=shapes(args),
        data=load_inputs(args.input) if args.input else None,
        reference=args.reference,
        golden=args.golden,
        save_golden_to=args.save_golden,
        precision=args.precision,
        device=args.device,
        atol=args.atol,
        rtol=args.rtol,
        seed=args.seed,
        rule=args.rule,
        equal_nan=args.equal_nan,
        topk=args.topk,
        min_cosine=args.min_cosine,
        min_top1=args.min_top1,
        require_all=args.require_all,
    )
    report(args, result.to_json(), result.table())
    if not result.ran:
        print("enginekit compare: nothing was compared: every backend was skipped", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK if result.passed else EXIT_VERIFY


# -- bench ---------------------------------------------------------------------------------------


def add_bench(sub: Any) -> None:
    """Register ``enginekit bench``."""
    p = sub.add_parser(
        "bench",
        help="latency percentiles and throughput of engines per batch size",
        description="Exit codes: 0 ok, 1 a batch size could not run, 2 usage (e.g. --duration 0).",
    )
    p.add_argument("engines", nargs="+", metavar="ENGINE", help="engine artifacts (.ekit or dir)")
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="comma-separated, e.g. 1,2,4,8 (default: powers of two across the profile)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="timed seconds per batch size (default 1, or none with --runs)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed calls per batch size (stops at whichever of --duration/--runs comes first)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="seconds of untimed calls per batch size (at least one call)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="timed rounds; reports their median and spread"
    )
    p.add_argument(
        "--unstable-spread",
        type=float,
        default=0.10,
        help="round spread that flags a result unstable",
    )
    p.add_argument(
        "--no-stabilize",
        action="store_true",
        help="do not re-measure unstable results (by default they get more rounds until their "
        "last --rounds agree, within the planned time again)",
    )
    add_inputs(p, "inputs to tile to each batch size instead of random ones")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="engine name in the report/plot (one per engine)",
    )
    p.add_argument("--device", default=None, help="override the artifacts' device")
    p.add_argument("--plot", metavar="PNG", help="write throughput and p99 latency vs batch size")
    add_json_report(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """``enginekit bench``: exit 0, or 1 when a batch size could not run."""
    from enginekit.backends import load
    from enginekit.evaluate.bench import bench_many, check_settings, plot
    from enginekit.evaluate.report import bench_table

    duration = args.duration if args.duration is not None or args.runs is not None else 1.0
    sizes = ints(args.batch_sizes, "--batch-sizes") if args.batch_sizes is not None else None
    check_settings(sizes, duration, args.runs, args.warmup, args.rounds)
    if args.label and len(args.label) != len(args.engines):
        raise UsageError(f"{len(args.label)} --label for {len(args.engines)} engines")
    engines = [load(path, device=args.device) for path in args.engines]
    try:
        results = bench_many(
            engines,
            sizes,
            duration=duration,
            runs=args.runs,
            warmup=args.warmup,
            rounds=args.rounds,
            data=load_inputs(args.input) if args.input else None,
            labels=args.label or [Path(p).name for p in args.engines],
            unstable_spread=args.unstable_spread,
            stabilize=not args.no_stabilize,
        )
    finally:
        for e in engines:
            e.close()
    text = bench_table(results)
    if args.plot:
        text += f"\nplot written to {plot(results, args.plot)}"
    reports = [r.to_json() for r in results]
    for entry, path in zip(reports, args.engines):
        entry["engine"]["path"] = path
    report(args, {"schema": "enginekit.bench/1", "engines": reports}, text)
    failed = [(r.label, b.batch, b.error) for r in results for b in r.results if b.error]
    for label, batch, error in failed:
        print(f"enginekit bench: {label} batch {batch}: {error}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK
