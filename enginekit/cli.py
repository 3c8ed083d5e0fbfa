"""The ``enginekit`` command line: build, run, inspect, backends, compare, bench, validate, cache,
export-triton.

Exit codes: 0 ok, 1 failure (a typed enginekit error), 2 usage error (with ``build -c``: an
invalid build file or baseline), 3 verification failed (with ``build -c``: a gate failed —
accuracy, top-1 agreement, throughput regression — or an engine failed verification).
Every command that prints a result takes ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from enginekit.errors import UsageError  # bad usage, from here or the library: exit code 2

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY = 0, 1, 2, 3


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"-O {text!r}: expected key=value (value in JSON, or a plain string)")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


# -- build -------------------------------------------------------------------------------------


def _add_build(sub: Any) -> None:
    p = sub.add_parser("build", help="build an engine artifact from an ONNX model")
    p.add_argument("model", nargs="?", help="ONNX model file (not with -c)")
    p.add_argument("--backend", default="onnxruntime", help="backend name (default onnxruntime)")
    p.add_argument(
        "--shapes",
        action="append",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="trtexec syntax: name:AxB (fixed) or name:min,opt,max; several inputs separated by "
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
    p.add_argument("--rtol", type=float, help="verification relative tolerance")
    p.add_argument(
        "-O",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (value parsed as JSON when it is JSON); see `enginekit backends --json`",
    )
    _add_pass_flags(p)
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _add_tensorrt_flags(p)
    _add_tvm_flags(p)
    from enginekit.cli_bench import add_auto_flags

    add_auto_flags(p)
    from enginekit.pipeline.cli import add_build_flags

    add_build_flags(p)
    p.set_defaults(func=_cmd_build)


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
    g.add_argument("--tune-trials", type=int, help="MetaSchedule trials per tuned batch size")
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
        out["target"] = _parse_option(f"target={args.target}")[1]
    if args.tune_trials is not None:
        out["tune"] = {"trials": args.tune_trials} | (
            {"batch_sizes": args.tune_batch} if args.tune_batch else {}
        )
    elif args.tune_batch:
        raise UsageError("--tune-batch needs --tune-trials N")
    if args.tuning_db:
        out["tuning_db"] = args.tuning_db
    return out


def _cmd_build(args: argparse.Namespace) -> int:
    import enginekit as ek
    from enginekit.cli_bench import auto_requested, cmd_build_auto

    if args.config:
        from enginekit.pipeline.cli import cmd_build_config

        return cmd_build_config(args)
    if not args.model or not args.output:
        raise UsageError("build needs a model and -o OUTPUT (or -c enginekit.toml)")
    options = dict(_parse_option(o) for o in args.option)
    options.update(backend_flag_options(args))
    options.update(_tvm_options(args))
    shapes = [s for group in args.shapes for s in group]
    if auto_requested(args) and (args.no_simplify or args.outputs):
        raise UsageError("--no-simplify and --outputs apply to one backend; name it, not auto")
    if auto_requested(args) and _calibration_requested(args):
        raise UsageError("the int8 calibration flags apply to one backend; name it, not auto")
    if auto_requested(args):
        return cmd_build_auto(args, ek.parse_shapes(shapes) if shapes else None, options)
    engine = ek.build(
        args.model,
        backend=args.backend,
        shapes=ek.parse_shapes(shapes) if shapes else None,
        precision=args.precision,
        output=args.output,
        device=args.device,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        **_pass_options(args),
        **_calibration_kwargs(args),
        **options,
    )
    m = engine.manifest
    verify = m.get("verify") or {}
    if verify.get("kind") == "accuracy":
        _emit(args, m, _accuracy_text(args.output, m))
        engine.close()
        return EXIT_OK
    text = (
        f"built {args.output}: {m['backend']['name']} {m['backend']['version']}, "
        f"{m['precision']}, {m['build']['build_s']:.2f} s\n"
        + (
            f"verified against ONNX Runtime CPU: max abs error {_max_abs(verify):.3g} "
            f"(atol {verify['atol']}, rtol {verify['rtol']})"
            if verify
            else "not verified (--no-verify)"
        )
    )
    _emit(args, m, text)
    engine.close()
    return EXIT_OK


def _max_abs(report: dict[str, Any]) -> float:
    values = [o.get("max_abs", 0.0) for c in report.get("cases", []) for o in c["outputs"].values()]
    values += [o.get("max_abs", 0.0) for o in report.get("outputs", {}).values()]
    return max(values, default=0.0)


def _add_pass_flags(p: argparse.ArgumentParser) -> None:
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


def _pass_options(args: argparse.Namespace) -> dict[str, Any]:
    outputs = [o for o in (args.outputs or "").split(",") if o]
    return {"simplify": not args.no_simplify, "outputs": outputs}


# -- run ---------------------------------------------------------------------------------------


def load_inputs(specs: Sequence[str]) -> dict[str, np.ndarray]:
    """Inputs from ``name=file.npy`` and ``file.npz`` (one key per input) arguments."""
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"--input {spec!r}: no such file {p}")
        try:
            if p.suffix == ".npz":
                if name:
                    raise UsageError(
                        f"--input {spec!r}: give an .npz without a name (its keys are the names)"
                    )
                with np.load(p, allow_pickle=False) as z:
                    feeds.update({k: z[k] for k in z.files})
            elif name:
                feeds[name] = np.load(p, allow_pickle=False)
            else:
                raise UsageError(
                    f"--input {spec!r}: use name=file.npy, or an .npz holding all inputs"
                )
        except (ValueError, OSError) as exc:
            raise UsageError(f"--input {spec!r}: cannot read {p}: {exc}") from None
    return feeds


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            cast(Any, np.savez)(f, **arrays)  # numpy stubs type **kwds as bool
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run an engine artifact on inputs from .npy/.npz files")
    p.add_argument("artifact")
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE.npy|FILE.npz",
        help="inputs",
    )
    p.add_argument("-o", "--output", help="write outputs to this .npz")
    p.add_argument("--device", help="override the artifact's device")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    import enginekit as ek

    if not args.input:
        raise UsageError("run needs --input name=file.npy (repeat per input) or --input inputs.npz")
    feeds = load_inputs(args.input)
    with ek.load(args.artifact, device=args.device) as engine:
        start = time.perf_counter()
        outputs = engine.infer(feeds)
        elapsed = time.perf_counter() - start
    if args.output:
        _save_npz(Path(args.output), outputs)
    summary = {
        name: {
            "shape": list(a.shape),
            "dtype": str(a.dtype),
            **(
                {
                    "min": float(np.nanmin(a)),
                    "max": float(np.nanmax(a)),
                    "mean": float(np.nanmean(a)),
                }
                if a.size and a.dtype.kind in "fiu"
                else {}
            ),
        }
        for name, a in outputs.items()
    }
    lines = [
        f"{n}: {s['dtype']}{s['shape']}"
        + (f" min {s['min']:.4g} max {s['max']:.4g} mean {s['mean']:.4g}" if "min" in s else "")
        for n, s in summary.items()
    ]
    lines.append(
        f"{elapsed * 1e3:.2f} ms" + (f"; outputs written to {args.output}" if args.output else "")
    )
    _emit(args, {"outputs": summary, "seconds": elapsed, "written": args.output}, "\n".join(lines))
    return EXIT_OK


# -- inspect -----------------------------------------------------------------------------------


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="describe an ONNX model or an engine artifact")
    p.add_argument("path")
    p.add_argument("--ir", action="store_true", help="include the backend's compiled IR summary")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)


def inspect_model(path: str) -> dict[str, Any]:
    """IO specs, opset, op counts, hash, and the batch lint of an ONNX model."""
    from collections import Counter

    import enginekit as ek

    model = ek.load_model(path)
    info: dict[str, Any] = {
        "kind": "onnx",
        "path": path,
        "sha256": model.sha256,
        "opset": model.opset,
        "producer": f"{model.proto.producer_name} {model.proto.producer_version}".strip(),
        "inputs": [s.to_json() for s in model.inputs],
        "outputs": [s.to_json() for s in model.outputs],
        "nodes": len(model.proto.graph.node),
        "initializers": len(model.proto.graph.initializer),
        "ops": dict(Counter(op for _, op in model.ops).most_common()),
    }
    if model.inputs and all(s.shape and isinstance(s.shape[0], str) for s in model.inputs):
        try:
            issues = ek.lint_batch(model)
            info["batch_lint"] = {"passed": not issues, "issues": [str(i) for i in issues]}
        except ek.EnginekitError as exc:
            info["batch_lint"] = {"passed": None, "issues": [str(exc)]}
    return info


def inspect_artifact(path: str, ir: bool = False) -> dict[str, Any]:
    """The manifest of an artifact, plus what its backend reports about the payload."""
    from enginekit import backends
    from enginekit.artifact import open_artifact

    artifact = open_artifact(path)
    info = {"kind": "artifact", "path": path, **artifact.manifest}
    name = artifact.manifest["backend"]["name"]
    try:
        backend = backends.get(name)
    except backends.BackendUnavailable:
        backend = None
    hook: Callable[..., dict[str, Any]] | None = getattr(backend, "inspect", None)
    if hook is not None:
        info["backend_details"] = hook(artifact, ir=ir)
    return info


def _format_specs(specs: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{s['name']}: {s['dtype']}[{'x'.join(map(str, s['shape'])) or 'scalar'}]" for s in specs
    )


def _cmd_inspect(args: argparse.Namespace) -> int:
    from enginekit.artifact import MANIFEST

    p = Path(args.path)
    is_artifact = (p.is_dir() and (p / MANIFEST).exists()) or (
        p.is_file() and p.suffix != ".onnx" and _is_zip(p)
    )
    if is_artifact:
        info = inspect_artifact(args.path, ir=args.ir)
        verify = info.get("verify") or {}
        lines = [
            f"artifact   {args.path} (format {info['format_version']}, enginekit {info['enginekit_version']})",
            f"backend    {info['backend']['name']} {info['backend']['version']} {info['backend'].get('metadata', {})}",
            f"precision  {info['precision']}   device {info['config']['device']}",
            f"inputs     {_format_specs(info['inputs'])}",
            f"outputs    {_format_specs(info['outputs'])}",
            f"profiles   {_profiles_text(info['profiles']) or 'none (any size)'}",
            f"source     sha256 {info['source']['sha256'][:16]}… opset {info['source']['opset']} {info['source'].get('path') or ''}",
            f"target     {info['target'].get('kind', 'cpu')} {info['target'].get('cpu', '')}",
            f"built      {info['build']['created']} in {info['build']['build_s']} s; key {info['build_key'][:16]}…",
            "verified   "
            + (
                f"{'passed' if verify['passed'] else 'FAILED'}, max abs error {_max_abs(verify):.3g}"
                if verify
                else "no"
            ),
            "payload    " + ", ".join(f"{n} ({e['size']} B)" for n, e in info["payload"].items()),
            "passes     "
            + (
                ", ".join(
                    f"{p['name']} {p['nodes_before']}->{p['nodes_after']} nodes"
                    for p in info.get("passes", [])
                )
                or "none"
            ),
        ]
        for key, value in (info.get("backend_details") or {}).items():
            lines.append(f"{key:<10} {value}")
    else:
        info = inspect_model(args.path)
        lines = [
            f"model      {args.path} (opset {info['opset']}, {info['producer'] or 'unknown producer'})",
            f"sha256     {info['sha256']}",
            f"inputs     {_format_specs(info['inputs'])}",
            f"outputs    {_format_specs(info['outputs'])}",
            f"nodes      {info['nodes']} ({', '.join(f'{k} {v}' for k, v in info['ops'].items())})",
        ]
        lint = info.get("batch_lint")
        if lint:
            verdict = "ok" if lint["passed"] else "PROBLEMS: " + "; ".join(lint["issues"])
            lines.append(f"batch lint {verdict}")
    _emit(args, info, "\n".join(lines))
    return EXIT_OK


def _is_zip(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _profiles_text(profiles: list[dict[str, Any]]) -> str:
    return " ".join(
        f"{n}:{','.join('x'.join(map(str, s)) for s in v)}" for p in profiles for n, v in p.items()
    )


# -- backends ----------------------------------------------------------------------------------


def _add_backends(sub: Any) -> None:
    p = sub.add_parser("backends", help="list backends: installed, versions, devices, why not")
    p.add_argument("--json", action="store_true")
    p.add_argument("--ops", action="store_true", help="also list each backend's supported ONNX ops")
    p.set_defaults(func=_cmd_backends)


def _cmd_backends(args: argparse.Namespace) -> int:
    from enginekit import backends

    rows = []
    for name in backends.names():
        avail = backends.availability(name)
        row = avail.to_json()
        module = backends.get(name)
        row["options"] = dict(getattr(module, "OPTIONS", {}))
        row["precisions"] = list(getattr(module, "PRECISIONS", ("fp32",)))
        ops = getattr(module, "supported_ops", None)
        if ops is not None:
            row["supported_ops"] = ops()
        rows.append(row)
    lines = []
    for r in rows:
        if r["available"]:
            lines.append(
                f"{r['name']:<12} {r['version']:<14} devices: {', '.join(r['devices'])}; precisions: {', '.join(r['precisions'])}"
            )
        else:
            lines.append(f"{r['name']:<12} {'unavailable':<14} {r['reason']}")
        if getattr(args, "ops", False) and r.get("supported_ops"):
            lines.append(_ops_text(r["supported_ops"]))
    _emit(args, rows, "\n".join(lines))
    return EXIT_OK


def _ops_text(ops: list[str], width: int = 100) -> str:
    """An op list wrapped and indented under its backend's line."""
    import textwrap

    body = textwrap.fill(", ".join(ops), width=width, initial_indent="  ", subsequent_indent="  ")
    return f"  {len(ops)} ONNX ops:\n{body}"


# -- export and prepare (enginekit/cli_export.py holds their work) ---------------------------


def _add_export(sub: Any) -> None:
    from enginekit.cli_export import add_export

    add_export(sub)


def _add_prepare(sub: Any) -> None:
    from enginekit.cli_export import add_prepare

    add_prepare(sub)


# -- compare, bench (enginekit/cli_bench.py) -----------------------------------------------------


def _add_compare(sub: Any) -> None:
    from enginekit.cli_bench import add_compare

    add_compare(sub)


def _add_bench(sub: Any) -> None:
    from enginekit.cli_bench import add_bench

    add_bench(sub)


# -- calibrate, and the int8 flags of build ----------------------------------------------------


def _add_calibrate(sub: Any) -> None:
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
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import enginekit as ek
    from enginekit.calibration import writers

    table = ek.calibrate(
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
    _emit(args, info, text)
    return EXIT_OK


def _add_build_calibration_flags(sub: Any) -> None:
    g = sub.choices["build"].add_argument_group("int8")
    g.add_argument("--calibration", metavar="CALIB.json", help="calibration table")
    g.add_argument("--calib-data", metavar="DATA", help="calibrate on this data (.npz/.npy/dir)")
    g.add_argument("--calib-method", default="entropy", choices=["entropy", "percentile", "minmax"])
    g.add_argument("--verify-data", metavar="DATA", help="verify the engine on this data")
    g.add_argument("--min-top1-agreement", type=float, help="gate, e.g. 0.99")
    g.add_argument("--max-abs-error", type=float, help="gate on any output element")
    g.add_argument(
        "--allow-table-mismatch", action="store_true",
        help="accept a calibration table made for another model hash",
    )  # fmt: skip


def _calibration_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("calibration", "calib_data", "verify_data", "min_top1_agreement", "max_abs_error")
    kwargs: dict[str, Any] = {n: getattr(args, n, None) for n in names}
    kwargs["calib_method"] = getattr(args, "calib_method", "entropy")
    kwargs["allow_table_mismatch"] = getattr(args, "allow_table_mismatch", False)
    return kwargs


def _calibration_requested(args: argparse.Namespace) -> bool:
    kwargs = _calibration_kwargs(args)
    return any(kwargs[k] not in (None, False) for k in kwargs if k != "calib_method")


def _accuracy_text(output: str, m: dict[str, Any]) -> str:
    from enginekit.calibration.accuracy import summarize

    v = m["verify"]
    cal = m.get("calibration") or {}
    how = f"{cal['method']} table {cal['sha256'][:12]}…" if "sha256" in cal else cal.get("source")
    return (
        f"built {output}: {m['backend']['name']} {m['backend']['version']}, {m['precision']} "
        f"({how}), {m['build']['build_s']:.2f} s\n"
        f"verified against float32 on {v['data']} ({v['samples']} samples): {summarize(v)}"
    )


# -- validate, cache, export-triton (enginekit/pipeline/cli.py) ----------------------------------


def _add_pipeline(sub: Any) -> None:
    from enginekit.pipeline.cli import add_cache, add_export_triton, add_validate

    add_validate(sub)
    add_cache(sub)
    add_export_triton(sub)


# -- main --------------------------------------------------------------------------------------

#: Subcommand registrars; features add theirs here.
COMMANDS: list[Callable[[Any], None]] = [
    _add_build,
    _add_run,
    _add_inspect,
    _add_backends,
    _add_compare,
    _add_bench,
    _add_pipeline,
]
COMMANDS += [_add_export, _add_prepare]
COMMANDS += [_add_calibrate, _add_build_calibration_flags]


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``enginekit`` command."""
    import enginekit

    p = argparse.ArgumentParser(
        prog="enginekit",
        description="Turn trained models into fast, verified inference engines.",
        epilog="exit codes: 0 ok, 1 failure, 2 usage error (or invalid build file), 3 "
        "verification or a build -c gate failed",
    )
    p.add_argument("--version", action="version", version=f"enginekit {enginekit.__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``enginekit`` console script; returns the exit code."""
    args = parser().parse_args(argv)
    level = (
        logging.WARNING
        if args.verbose == 0
        else logging.INFO
        if args.verbose == 1
        else logging.DEBUG
    )
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from enginekit.errors import EnginekitError, VerificationError

    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"enginekit {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except VerificationError as exc:
        print(f"enginekit {args.command}: verification failed: {exc}", file=sys.stderr)
        return EXIT_VERIFY
    except EnginekitError as exc:
        print(f"enginekit {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
