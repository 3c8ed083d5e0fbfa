"""Command-line parts for ``enginekit compare``, ``enginekit bench`` and ``build --backend auto``.

Registered from :mod:`enginekit.cli`. In these commands ``--json`` takes an optional path:
``--json`` alone prints the JSON report to stdout (instead of the table); ``--json FILE``
writes it to FILE and still prints the table. Put ``--json`` after the positional arguments
(or write ``--json -``), since a bare word after it is taken as its path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from enginekit.cli import EXIT_FAILURE, EXIT_OK, EXIT_VERIFY, _parse_option, load_inputs
from enginekit.errors import UsageError

STDOUT = "-"


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH",
        help="JSON report: alone (or '-') print it to stdout instead of the table; with PATH "
        "write it there and print the table",
    )


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_json_path(args: argparse.Namespace) -> None:
    if args.json not in (None, STDOUT) and Path(args.json).suffix in (".ekit", ".onnx"):
        raise UsageError(
            f"--json {args.json!r} looks like a model or engine, not a report path; put --json "
            "after the positional arguments or give it a .json path"
        )


def _report(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json == STDOUT:
        print(json.dumps(data, indent=2))
        return
    if args.json is not None:
        _write_json(Path(args.json), data)
    print(text)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: expected integers separated by commas, e.g. 1,8,32"
        ) from None


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_candidate(tokens: list[str]) -> Any:
    """``NAME [KEY=VALUE ...]`` as a Candidate; keys ``precision``, ``model`` and ``label`` are
    the candidate's own, every other key a backend option (values parsed as JSON when they are)."""
    from enginekit.candidates import Candidate

    name, *rest = tokens
    fields: dict[str, Any] = {}
    options = {}
    for token in rest:
        if "=" not in token:
            raise UsageError(
                f"--candidate {' '.join(tokens)}: {token!r} is not KEY=VALUE (a positional "
                "argument such as the model goes before --candidate)"
            )
        key, value = _parse_option(token)
        if key in ("precision", "model", "label"):
            fields[key] = str(value)
        else:
            options[key] = value
    return Candidate(name, options, **fields)


def _shapes(args: argparse.Namespace) -> Any:
    import enginekit as ek

    specs = [s for group in args.shapes for s in group]
    return ek.parse_shapes(specs) if specs else None


def _add_shapes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        action="append",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="trtexec syntax: name:AxB or name:min,opt,max (several inputs separated by spaces)",
    )


def _add_candidate(p: Any) -> None:
    p.add_argument(
        "--candidate",
        action="append",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="NAME [KEY=VALUE ...]: a backend with options, e.g. --candidate onnxruntime optimization_level=disable "
        "intra_op_threads=1; keys precision=, model= (an equivalent model variant) and label= "
        "are the candidate's own; repeat for more",
    )


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
    _add_candidate(p)
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ARTIFACT",
        help="a built engine to compare; repeatable",
    )
    _add_shapes(p)
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE.npy|FILE.npz",
        help="inputs to use instead of random ones",
    )
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
        "--equal-nan", action="store_true", help="NaN where the reference has NaN agrees"
    )
    p.add_argument("--topk", type=int, default=5, help="k of top-k agreement (classifier outputs)")
    p.add_argument("--min-cosine", type=float, help="also fail below this cosine similarity")
    p.add_argument("--min-top1", type=float, help="also fail below this top-1 agreement")
    p.add_argument("--require-all", action="store_true", help="a skipped backend fails the gate")
    _add_json(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """``enginekit compare``: exit 0 passed, 3 failed, 1 nothing compared."""
    import enginekit as ek

    _check_json_path(args)
    if args.golden and args.save_golden:
        raise UsageError("--golden and --save-golden together would only copy the file")
    if args.golden and args.input:
        raise UsageError("--golden holds the inputs; drop --input")
    entries: list[Any] = _names(args.backends) if args.backends else []
    entries += [parse_candidate(t) for t in args.candidate]
    entries += list(args.engine)
    if args.model is None and not args.engine:
        raise UsageError("compare needs the ONNX model, or --engine ARTIFACT with --golden FILE")
    report = ek.compare(
        args.model,
        entries or None,
        shapes=_shapes(args),
        data=load_inputs(args.input) if args.input else None,
        reference=args.reference,
        golden=args.golden,
        save_golden_to=args.save_golden,
        precision=args.precision,
        device=args.device,
        atol=args.atol,
        rtol=args.rtol,
        seed=args.seed,
        equal_nan=args.equal_nan,
        topk=args.topk,
        min_cosine=args.min_cosine,
        min_top1=args.min_top1,
        require_all=args.require_all,
    )
    _report(args, report.to_json(), report.table())
    if not report.ran:
        print("enginekit compare: nothing was compared: every backend was skipped", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK if report.passed else EXIT_VERIFY


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
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE.npy|FILE.npz",
        help="inputs to tile to each batch size instead of random ones",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="engine name in the report/plot (one per engine)",
    )
    p.add_argument("--device", default=None, help="override the artifacts' device")
    p.add_argument("--plot", metavar="PNG", help="write throughput and p99 latency vs batch size")
    _add_json(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """``enginekit bench``: exit 0, or 1 when a batch size could not run."""
    import enginekit as ek
    from enginekit.bench import bench_many, check_settings, plot

    _check_json_path(args)
    duration = args.duration if args.duration is not None or args.runs is not None else 1.0
    sizes = _ints(args.batch_sizes, "--batch-sizes") if args.batch_sizes is not None else None
    check_settings(sizes, duration, args.runs, args.warmup, args.rounds)
    if args.label and len(args.label) != len(args.engines):
        raise UsageError(f"{len(args.label)} --label for {len(args.engines)} engines")
    engines = [ek.load(path, device=args.device) for path in args.engines]
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
        )
    finally:
        for e in engines:
            e.close()
    from enginekit.report import bench_table

    text = bench_table(results)
    if args.plot:
        text += f"\nplot written to {plot(results, args.plot)}"
    reports = [r.to_json() for r in results]
    for report, path in zip(reports, args.engines):
        report["engine"]["path"] = path
    _report(args, {"schema": "enginekit.bench/1", "engines": reports}, text)
    failed = [(r.label, b.batch, b.error) for r in results for b in r.results if b.error]
    for label, batch, error in failed:
        print(f"enginekit bench: {label} batch {batch}: {error}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# -- build --backend auto --------------------------------------------------------------------------


def add_auto_flags(p: argparse.ArgumentParser) -> None:
    """The ``build`` flags that only ``--backend auto`` uses."""
    g = p.add_argument_group(
        "--backend auto", "build every candidate, verify, bench, keep the best"
    )
    g.add_argument(
        "--precisions",
        default=None,
        help="precisions to try, e.g. fp32,int8 (default: --precision)",
    )
    g.add_argument(
        "--objective",
        default=None,
        choices=["latency", "throughput"],
        help="latency: p50 at the opt shape (default); throughput: samples/s at the max batch",
    )
    g.add_argument(
        "--bench-duration", type=float, default=None, help="timed seconds per candidate (default 1)"
    )
    _add_candidate(g)


def auto_requested(args: argparse.Namespace) -> bool:
    """Whether to build with auto; auto-only flags without ``--backend auto`` are a usage error."""
    if args.backend == "auto":
        return True
    given = [f for f, v in (("--precisions", args.precisions), ("--objective", args.objective),
             ("--bench-duration", args.bench_duration), ("--candidate", args.candidate)) if v]  # fmt: skip
    if given:
        raise UsageError(f"{', '.join(given)} only apply with --backend auto")
    return False


def cmd_build_auto(args: argparse.Namespace, shapes: Any, options: dict[str, Any]) -> int:
    """``enginekit build --backend auto``: prints every candidate's result and the winner."""
    import enginekit as ek
    from enginekit.report import auto_table

    if args.no_verify:
        raise UsageError("--backend auto verifies every candidate; drop --no-verify")
    if args.bench_duration is not None and not args.bench_duration > 0:
        raise UsageError(f"--bench-duration must be > 0 seconds, got {args.bench_duration}")
    extra: dict[str, Any] = {}
    if args.precisions:
        extra["precisions"] = _names(args.precisions)
    if args.candidate:
        extra["candidates"] = [parse_candidate(t) for t in args.candidate]
    if args.objective:
        extra["objective"] = args.objective
    if args.bench_duration is not None:
        extra["bench_duration"] = args.bench_duration
    engine = ek.build(
        args.model,
        backend="auto",
        shapes=shapes,
        precision=args.precision,
        output=args.output,
        device=args.device,
        atol=args.atol,
        rtol=args.rtol,
        **extra,
        **options,
    )
    m = engine.manifest
    engine.close()
    text = f"{auto_table(m['auto'])}\nbuilt {args.output}: {m['backend']['name']} {m['backend']['version']}, {m['precision']}"
    print(json.dumps(m, indent=2, default=str) if args.json else text)
    return EXIT_OK
