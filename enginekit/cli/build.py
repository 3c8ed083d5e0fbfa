"""``enginekit build``: one backend, ``--backend auto`` (every candidate, keep the best), or a
whole build file with ``-c enginekit.toml``.

Exit codes of ``build -c``: 0 every entry built and every gate passed; 1 an entry could not be
built (with ``--strict`` also: its backend is unavailable here); 2 the build file or baseline is
invalid, or bad usage; 3 a gate failed or an engine failed its build-time verification.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from enginekit.cli.common import (
    EXIT_OK,
    add_candidate,
    add_shapes,
    annotate,
    config_errors,
    emit,
    github,
    max_abs,
    names,
    parse_candidate,
    parse_option,
    shapes,
)
from enginekit.errors import UsageError


def add(sub: Any) -> None:
    """Register ``enginekit build`` with all its flag groups."""
    p = sub.add_parser("build", help="build an engine artifact from an ONNX model")
    p.add_argument("model", nargs="?", help="ONNX model file (not with -c)")
    p.add_argument("--backend", default="onnxruntime", help="backend name (default onnxruntime)")
    add_shapes(
        p,
        "trtexec syntax: name:AxB (fixed) or name:min,opt,max; several inputs separated by "
        "spaces or repeated flags; naming an input again adds a profile",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "-o",
        "--output",
        "--out",
        help="artifact path (.ekit, or dir/ for a directory); with -c the output folder",
    )
    p.add_argument("--no-verify", action="store_true", help="skip build-time verification")
    p.add_argument("--atol", type=float, help="verification absolute tolerance")
    p.add_argument(
        "--rtol",
        type=float,
        help="verification relative tolerance: of each output's scale max|ref| (scaled rule) or "
        "of each element (elementwise)",
    )
    p.add_argument(
        "--rule",
        default="scaled",
        choices=["scaled", "elementwise"],
        help="verification rule (default scaled: error relative to each output's scale, plus "
        "cosine similarity); see docs/verification.md",
    )
    p.add_argument("--min-cosine", type=float, help="cosine floor (default: the precision's)")
    p.add_argument(
        "--verify-data",
        metavar="DATA",
        help="verify on this data (.npz, .npy, or a folder of .npy/.npz), any precision",
    )
    p.add_argument(
        "-O",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (value parsed as JSON when it is JSON); see `enginekit backends --json`",
    )
    p.add_argument(
        "--no-simplify",
        action="store_true",
        help="skip graph simplification (constant folding, dead nodes, shape inference)",
    )
    p.add_argument(
        "--outputs",
        metavar="A,B",
        help="build only the subgraph computing these tensors (intermediate ones too), to debug",
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _add_tensorrt_flags(p)
    _add_tvm_flags(p)
    _add_auto_flags(p)
    _add_config_flags(p)
    _add_int8_flags(p)
    p.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    """``enginekit build``: one backend, auto, or ``-c`` (each prints what it built)."""
    if args.config:
        return _cmd_build_config(args)
    if not args.model or not args.output:
        raise UsageError("build needs a model and -o OUTPUT (or -c enginekit.toml)")
    options = dict(parse_option(o) for o in args.option)
    options.update(backend_flag_options(args))
    options.update(_tvm_options(args))
    if _auto_requested(args) and (args.no_simplify or args.outputs):
        raise UsageError("--no-simplify and --outputs apply to one backend; name it, not auto")
    if _auto_requested(args):
        return _cmd_build_auto(args, options)
    from enginekit.build import build

    engine = build(
        args.model,
        backend=args.backend,
        shapes=shapes(args),
        precision=args.precision,
        output=args.output,
        device=args.device,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        rule=args.rule,
        min_cosine=args.min_cosine,
        verify_data=args.verify_data,
        simplify=not args.no_simplify,
        outputs=[o for o in (args.outputs or "").split(",") if o],
        **_calibration_kwargs(args),
        **options,
    )
    m = engine.manifest
    engine.close()
    verify = m.get("verify") or {}
    if verify.get("kind") == "accuracy":
        emit(args, m, _accuracy_text(args.output, m))
        return EXIT_OK
    text = (
        f"built {args.output}: {m['backend']['name']} {m['backend']['version']}, "
        f"{m['precision']}, {m['build']['build_s']:.2f} s\n"
        + (
            f"verified against ONNX Runtime CPU on {verify.get('data', 'generated inputs')}: "
            f"max abs error {max_abs(verify):.3g}"
            + _scaled_text(verify)
            + f" ({verify.get('rule', 'elementwise')} rule, atol {verify['atol']}, rtol "
            f"{verify['rtol']})"
            if verify
            else "not verified (--no-verify)"
        )
    )
    emit(args, m, text + _serving_text(m))
    return EXIT_OK


def _serving_text(m: dict[str, Any]) -> str:
    """One line per tuned batch size: whether its tuned module serves, and both times."""
    tuning = (m.get("backend", {}).get("metadata") or {}).get("tuning") or {}
    serving = tuning.get("serving") or {}
    return "".join(f"\ntuned batch {b}: {d['decision']}" for b, d in serving.items())


def _scaled_text(verify: dict[str, Any]) -> str:
    """ ", 2.6e-07 of the output's scale, cosine 1" for the worst output of a report."""
    worst = verify.get("worst") or {}
    errors = [o.get("scaled_error") for o in worst.values()]
    cosines = [o.get("cosine") for o in worst.values() if o.get("cosine") is not None]
    if not errors:
        return ""
    err = max(float("inf") if e is None else e for e in errors)
    text = f" = {err:.3g} of the output's scale"
    return text + (f", cosine {min(cosines):.7g}" if cosines else "")


# -- backend shorthands --------------------------------------------------------------------------


def _add_tensorrt_flags(p: argparse.ArgumentParser) -> None:
    """Shorthands for TensorRT backend options (each is also -O name=value)."""
    p.add_argument(
        "--timing-cache",
        metavar="PATH",
        help="tensorrt: timing cache file or directory, loaded and saved back (per GPU/version)",
    )
    p.add_argument("--workspace", metavar="SIZE", help="tensorrt: workspace limit, e.g. 4GiB")


def backend_flag_options(args: argparse.Namespace) -> dict[str, Any]:
    """Backend options given as their own flags (``--timing-cache``, ``--workspace``)."""
    flags = {"timing_cache": args.timing_cache, "workspace": args.workspace}
    return {k: v for k, v in flags.items() if v is not None}


def _add_tvm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tvm backend (shorthands for -O options)")
    g.add_argument("--layout", choices=["NHWC", "NCHW"], help="conv layout (default NHWC on CPU)")
    g.add_argument("--target", help="TVM target: JSON dict, 'llvm' (portable) or 'cuda'")
    g.add_argument("--tune-trials", type=int, help="tuning trials per tuned batch size")
    g.add_argument(
        "--tune-method",
        choices=["enginekit", "metaschedule"],
        help="tuner (default enginekit: its schedule's alternatives timed in the model)",
    )
    g.add_argument(
        "--tune-batch", type=int, action="append", help="batch size to tune (repeatable)"
    )
    g.add_argument("--tuning-db", help="tuning database directory to keep and reuse")


def _tvm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The --layout/--target/--tune-*/--tuning-db flags as backend options."""
    out: dict[str, Any] = {}
    if args.layout:
        out["layout"] = args.layout
    if args.target:
        out["target"] = parse_option(f"target={args.target}")[1]
    if args.tune_trials is not None:
        out["tune"] = (
            {"trials": args.tune_trials}
            | ({"batch_sizes": args.tune_batch} if args.tune_batch else {})
            | ({"method": args.tune_method} if args.tune_method else {})
        )
    elif args.tune_batch or args.tune_method:
        flag = "--tune-batch" if args.tune_batch else "--tune-method"
        raise UsageError(f"{flag} needs --tune-trials N")
    if args.tuning_db:
        out["tuning_db"] = args.tuning_db
    return out


# -- --backend auto ------------------------------------------------------------------------------


def _add_auto_flags(p: argparse.ArgumentParser) -> None:
    """The ``build`` flags that only ``--backend auto`` uses."""
    g = p.add_argument_group(
        "--backend auto", "build every candidate, verify, bench, keep the best"
    )
    g.add_argument(
        "--backends",
        default=None,
        metavar="A,B",
        help="backends to try (default: every registered one)",
    )
    g.add_argument(
        "--precisions",
        default=None,
        help="precisions to try, e.g. fp32,int8 (default: fp32, bf16 where the CPU has it, "
        "int8 with --calib-data/--calibration; or --precision when not fp32)",
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
    add_candidate(g)


def _auto_requested(args: argparse.Namespace) -> bool:
    """Whether to build with auto; auto-only flags without ``--backend auto`` are a usage error."""
    if args.backend == "auto":
        return True
    given = [f for f, v in (("--backends", args.backends), ("--precisions", args.precisions),
             ("--objective", args.objective),
             ("--bench-duration", args.bench_duration), ("--candidate", args.candidate)) if v]  # fmt: skip
    if given:
        raise UsageError(f"{', '.join(given)} only apply with --backend auto")
    return False


def _cmd_build_auto(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``enginekit build --backend auto``: prints every candidate's result and the winner."""
    from enginekit.build import build
    from enginekit.evaluate.report import auto_table

    if args.no_verify:
        raise UsageError("--backend auto verifies every candidate; drop --no-verify")
    if args.bench_duration is not None and not args.bench_duration > 0:
        raise UsageError(f"--bench-duration must be > 0 seconds, got {args.bench_duration}")
    extra: dict[str, Any] = {}
    if args.backends:
        extra["backends"] = names(args.backends)
    if args.precisions:
        extra["precisions"] = names(args.precisions)
    if args.candidate:
        extra["candidates"] = [parse_candidate(t) for t in args.candidate]
    if args.objective:
        extra["objective"] = args.objective
    if args.bench_duration is not None:
        extra["bench_duration"] = args.bench_duration
    engine = build(
        args.model,
        backend="auto",
        shapes=shapes(args),
        precision=args.precision,
        output=args.output,
        device=args.device,
        atol=args.atol,
        rtol=args.rtol,
        rule=args.rule,
        min_cosine=args.min_cosine,
        verify_data=args.verify_data,
        **_calibration_kwargs(args),
        **extra,
        **options,
    )
    m = engine.manifest
    engine.close()
    text = f"{auto_table(m['auto'])}\nbuilt {args.output}: {m['backend']['name']} {m['backend']['version']}, {m['precision']}"
    print(json.dumps(m, indent=2, default=str) if args.json else text)
    return EXIT_OK


# -- -c enginekit.toml ---------------------------------------------------------------------------


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """The ``-c`` flags of ``enginekit build``."""
    p.add_argument(
        "-c",
        "--config",
        metavar="TOML",
        help="build every entry of a build file (enginekit.toml) into -o DIR (default dist/); "
        "the model argument is then not given",
    )
    g = p.add_argument_group("with -c/--config")
    g.add_argument(
        "--cache",
        default=os.environ.get("ENGINEKIT_CACHE"),
        metavar="DIR",
        help="artifact cache folder, shared safely between jobs (default $ENGINEKIT_CACHE; "
        "none: build everything)",
    )
    g.add_argument(
        "--baseline",
        metavar="REPORT",
        help="a previous report.json to gate throughput regressions against (missing file: "
        "not compared)",
    )
    g.add_argument(
        "-j", "--jobs", type=int, default=1, help="entries built at once, in separate processes"
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 1) on entries whose backend is unavailable here instead of skipping "
        "them; build-file warnings become errors",
    )
    g.add_argument("--no-bench", action="store_true", help="skip the throughput measurement")
    g.add_argument(
        "--rebench",
        action="store_true",
        help="measure cached entries again (default: reuse their bench result from an earlier "
        "run with the same settings on this host)",
    )


#: The single-build flags at their defaults: any other value is a usage error with -c.
_SINGLE_BUILD_DEFAULTS = {
    "backend": "onnxruntime",
    "precision": "fp32",
    "device": "cpu",
    "shapes": [],
    "option": [],
    "no_verify": False,
    "atol": None,
    "rtol": None,
    "rule": "scaled",
    "min_cosine": None,
    "timing_cache": None,
    "workspace": None,
    "precisions": None,
    "objective": None,
    "bench_duration": None,
    "candidate": None,
    "no_simplify": False,
    "outputs": None,
    "calibration": None,
    "calib_data": None,
    "calib_method": "entropy",
    "verify_data": None,
    "min_top1_agreement": None,
    "max_abs_error": None,
    "accuracy_target": None,
    "allow_table_mismatch": False,
}


def _cmd_build_config(args: argparse.Namespace) -> int:
    """``enginekit build -c enginekit.toml``: the whole matrix, report and gates."""
    from enginekit.pipeline.config import ConfigError
    from enginekit.pipeline.report import markdown, strict_json
    from enginekit.pipeline.runner import run

    if args.model:
        raise UsageError("give a model or -c/--config, not both")
    given = [
        "--" + k.replace("_", "-")
        for k, default in _SINGLE_BUILD_DEFAULTS.items()
        if getattr(args, k, default) not in (default, None, False, [])
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} set(s) a single build; with -c put them in the build file's "
            "[[engine]] tables"
        )
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected >= 1")
    try:
        report = run(
            args.config,
            out=args.output or "dist",
            cache=args.cache,
            baseline=args.baseline,
            jobs=args.jobs,
            strict=args.strict,
            bench=not args.no_bench,
            rebench=args.rebench,
        )
    except ConfigError as exc:
        return config_errors(exc)
    if args.json:
        print(json.dumps(strict_json(report), indent=2, default=str))
    else:
        print(markdown(report))
    if github():
        for r in report["regressions"]:
            annotate("error", r, args.config)
    return int(report["exit_code"])


# -- int8 ----------------------------------------------------------------------------------------


def _add_int8_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("int8")
    g.add_argument("--calibration", metavar="CALIB.json", help="calibration table")
    g.add_argument("--calib-data", metavar="DATA", help="calibrate on this data (.npz/.npy/dir)")
    g.add_argument("--calib-method", default="entropy", choices=["entropy", "percentile", "minmax"])
    g.add_argument("--min-top1-agreement", type=float, help="gate, e.g. 0.99")
    g.add_argument("--max-abs-error", type=float, help="gate on any output element")
    g.add_argument(
        "--accuracy-target", metavar="TARGET",
        help="accuracy-aware int8: the fastest plan meeting it, the most sensitive layers kept "
        "in float: 'top1=0.97', 'max_abs=0.5', 'top1=0.97,fallback=float' (docs/calibration.md)",
    )  # fmt: skip
    g.add_argument(
        "--allow-table-mismatch", action="store_true",
        help="accept a calibration table made for another model hash",
    )  # fmt: skip


def _calibration_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("calibration", "calib_data", "min_top1_agreement", "max_abs_error")
    kwargs: dict[str, Any] = {k: getattr(args, k) for k in keys}
    kwargs["calib_method"] = args.calib_method
    kwargs["allow_table_mismatch"] = args.allow_table_mismatch
    if args.accuracy_target is not None:
        from enginekit.calibration.search import AccuracyTarget

        kwargs["accuracy_target"] = AccuracyTarget.parse(args.accuracy_target)
    return kwargs


def _accuracy_text(output: str, m: dict[str, Any]) -> str:
    from enginekit.calibration.accuracy import summarize

    v = m["verify"]
    cal = m.get("calibration") or {}
    how = f"{cal['method']} table {cal['sha256'][:12]}…" if "sha256" in cal else cal.get("source")
    text = (
        f"built {output}: {m['backend']['name']} {m['backend']['version']}, {m['precision']} "
        f"({how}), {m['build']['build_s']:.2f} s\n"
        f"verified against {v.get('reference') or 'float32'} on {v['data']} "
        f"({v['samples']} samples): {summarize(v)}"
    )
    found = cal.get("accuracy_search")
    if found:
        text += "\n" + plans_text(found)
    return text


def plans_text(found: dict[str, Any]) -> str:
    """The accuracy search's plans, one line each, and the layers kept in float (with a bf16
    float part: its f32 layers and the float-part plans tried first)."""
    lines = _float_part_lines(found.get("float_part"))
    lines.append(f"accuracy search ({found['measured_on']}), every plan tried:")
    if found.get("criterion"):
        lines.append(f"  a plan meets the target when {found['criterion']}")
    if found.get("speed_vs"):
        lines.append(f"  x fp32: against {found['speed_vs']}, timed alternately with each plan")
    for p in found["plans"]:
        agree, interval = p["top1_agreement"], p.get("top1_interval")
        shown = "-" if agree is None else f"{agree:.2%}"
        if interval:
            shown += f" [{interval[0]:.1%}, {interval[1]:.1%}]"
        if p.get("top1_lower_bound") is not None:
            shown += f" lower bound {p['top1_lower_bound']:.1%}"
        speed = f"{p['speedup_vs_fp32']:.2f}x fp32"
        if p.get("final_speedup_vs_fp32") is not None:  # timed again among the cheapest
            speed += f" (final timing {p['final_speedup_vs_fp32']:.2f}x)"
        lines.append(
            f"  {p['method']:<22} {p['float_layers']:>3} layers in float "
            f"({p.get('float_macs_share', 0.0):.0%} of MACs)  "
            f"top-1 {shown}  max abs {p['max_abs']:.3g}  "
            f"{speed}  {'met' if p['met'] else 'missed'}"
        )
    kept = found["kept_in_float"]
    lines.append(
        f"kept in float ({found['fallback_precision']}: {found['fallback_reason']}): "
        + (", ".join(k["layer"] for k in kept) if kept else "none")
    )
    return "\n".join(lines)


def _float_part_lines(part: dict[str, Any] | None) -> list[str]:
    """What the float part computes in; for a bf16 one, each float-part plan scored (the
    float model alone, no int8) and the f32 layers chosen, each with why."""
    if not part:
        return []
    if part["precision"] != "bf16":
        return [f"float part float32, bf16 not tried: {part['reason']}"]
    lines = [f"float part bf16 ({part['reason']}); f32 layers {part['f32_layers_chosen']}"]
    for p in part.get("plans", ()):
        agree, low = p["top1_agreement"], p.get("top1_lower_bound")
        shown = "-" if agree is None else f"{agree:.2%}"
        if low is not None:
            shown += f" lower bound {low:.1%}"
        lines.append(
            f"  float model, {p['f32_layers']:>3} layers f32, the rest bf16: top-1 {shown}  "
            f"NMSE {p['nmse']:.3g}  {'met' if p['met'] else 'missed'}"
        )
    lines += [f"  f32: {k['layer']} ({k['why']})" for k in part.get("f32_layers", ())]
    return lines
