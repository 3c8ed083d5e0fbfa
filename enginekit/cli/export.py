"""``enginekit export`` and ``enginekit prepare``: framework -> ONNX, and ONNX -> rewritten ONNX."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

from enginekit.cli.common import EXIT_OK, add_inputs, emit, format_specs, load_inputs
from enginekit.errors import UsageError
from enginekit.files import atomic_path

# -- export ------------------------------------------------------------------------------------


def add_export(sub: Any) -> None:
    """Register ``enginekit export``."""
    p = sub.add_parser(
        "export",
        help="export a TensorFlow, Keras or PyTorch model to ONNX, checked against the framework",
    )
    p.add_argument(
        "model",
        help="a SavedModel directory, a .keras file, or module:object / file.py:object naming a "
        "tf.function, Keras model or torch module (or a function returning one)",
    )
    p.add_argument("-o", "--output", required=True, help="the ONNX file to write")
    add_inputs(
        p, "example inputs (PyTorch models and TF functions without an input_signature need them)"
    )
    p.add_argument("--static-batch", action="store_true", help="keep the batch dim fixed")
    p.add_argument(
        "--dynamic",
        action="append",
        default=[],
        metavar="INPUT:AXIS=NAME",
        help="another dynamic dim, e.g. ids:1=seq (repeat; one name shared by inputs that agree)",
    )
    p.add_argument("--output-names", metavar="A,B", help="names of the outputs, in order")
    p.add_argument("--opset", type=int, help="ONNX opset (TensorFlow: 9..18)")
    p.add_argument("--signature", help="the SavedModel signature to export (serving_default)")
    p.add_argument("--no-check", action="store_true", help="skip the check against the framework")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)


_DYNAMIC = re.compile(r"^(?P<input>[^:]+):(?P<axis>-?\d+)=(?P<name>\w+)$")


def parse_dynamic(specs: list[str]) -> dict[str, dict[int, str]]:
    """``["ids:1=seq", "mask:1=seq"]`` -> ``{"ids": {1: "seq"}, "mask": {1: "seq"}}``."""
    out: dict[str, dict[int, str]] = {}
    for spec in specs:
        m = _DYNAMIC.match(spec)
        if not m:
            raise UsageError(f"--dynamic {spec!r}: expected INPUT:AXIS=NAME, e.g. ids:1=seq")
        out.setdefault(m["input"], {})[int(m["axis"])] = m["name"]
    return out


def resolve(spec: str) -> Any:
    """The object ``module:attr`` or ``file.py:attr`` names; a path stays a path.

    A function that no exporter takes is called without arguments and its result used, so
    ``models:make_model`` works as well as ``models:model``.
    """
    if os.path.exists(spec) or ":" not in spec:
        return spec
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(where).stem, where)
            if loader is None or loader.loader is None:
                raise ImportError(f"cannot load {where}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise UsageError(f"{spec}: cannot load it ({type(exc).__name__}: {exc})") from None
    from enginekit.export import exporters

    if callable(obj) and not any(m.accepts(obj) for m in exporters().values()):
        obj = obj()
    return obj


def _exportable(obj: Any) -> bool:
    from enginekit.export import exporters

    return isinstance(obj, (str, os.PathLike)) or any(m.accepts(obj) for m in exporters().values())


def _torch_example(model: Any, feeds: dict[str, Any] | None, given: Any, spec: str) -> Any:
    """The example inputs of a PyTorch model: ``-i NAME=FILE`` by forward() argument name."""
    import inspect as pyinspect

    import torch

    params = [
        p.name
        for p in pyinspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if feeds is None:
        if given is None:
            raise UsageError(
                f"{spec} is a PyTorch model: give example inputs with -i NAME=FILE.npy for each "
                f"forward() argument ({', '.join(params) or 'none'}), or return "
                "(model, example_inputs) from the entry function"
            )
        return given
    unknown = [n for n in feeds if n not in params]
    if unknown:
        from enginekit.errors import did_you_mean

        hints = "".join(did_you_mean(n, params) for n in unknown)
        raise UsageError(
            f"-i {', '.join(unknown)}: forward() of {spec} takes no argument of that name{hints} "
            f"(it takes: {', '.join(params)})"
        )
    ordered = [n for n in params if n in feeds]
    return tuple(torch.from_numpy(feeds[n]) for n in ordered)


def cmd_export(args: argparse.Namespace) -> int:
    """Export, check against the framework, and print the ONNX model's interface."""
    from enginekit.export import export
    from enginekit.export import torch as torch_export
    from enginekit.model import load_model

    model = resolve(args.model)
    entry_example: Any = None
    if isinstance(model, tuple) and len(model) == 2 and _exportable(model[0]):
        model, entry_example = model  # an entry returning (model, example_inputs)
    feeds = load_inputs(args.input) if args.input else None
    example: Any = feeds if feeds is not None else entry_example
    if torch_export.accepts(model):
        example = _torch_example(model, feeds, entry_example, args.model)
    options: dict[str, Any] = {
        "dynamic_batch": not args.static_batch,
        "dynamic_dims": parse_dynamic(args.dynamic) or None,
        "check": not args.no_check,
    }
    if args.output_names:
        options["output_names"] = [n for n in args.output_names.split(",") if n]
    if args.opset is not None:
        options["opset"] = args.opset
    if args.signature:
        options["signature"] = args.signature
    path = export(model, example, args.output, **options)
    written = load_model(path)
    info: dict[str, Any] = {
        "path": str(path),
        "opset": written.opset,
        "sha256": written.sha256,
        "inputs": [s.to_json() for s in written.inputs],
        "outputs": [s.to_json() for s in written.outputs],
        "checked": not args.no_check,
    }
    text = (
        f"exported {path} (opset {written.opset}"
        + (", checked against the framework" if info["checked"] else ", not checked")
        + f")\ninputs   {format_specs(info['inputs'])}\noutputs  {format_specs(info['outputs'])}"
    )
    emit(args, info, text)
    return EXIT_OK


# -- prepare -----------------------------------------------------------------------------------


def add_prepare(sub: Any) -> None:
    """Register ``enginekit prepare``."""
    p = sub.add_parser(
        "prepare",
        help="rewrite an ONNX model: subgraph, renaming, dynamic batch, simplification, opset",
    )
    p.add_argument("model", help="ONNX model file")
    p.add_argument("-o", "--output", required=True, help="the ONNX file to write")
    p.add_argument("--outputs", metavar="A,B", help="keep only the subgraph computing these")
    p.add_argument(
        "--rename", action="append", default=[], metavar="OLD=NEW", help="rename an input/output"
    )
    p.add_argument(
        "--batch-dynamic",
        action="store_true",
        help="make a fixed leading batch dim symbolic (legacy exports included), then lint it",
    )
    p.add_argument("--no-simplify", action="store_true", help="skip graph simplification")
    p.add_argument("--opset", type=int, help="convert to this ai.onnx opset")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    """Run the asked rewrites in a fixed order; print what each did (and the batch lint)."""
    from enginekit import passes
    from enginekit.errors import ModelError
    from enginekit.model import load_model

    source = load_model(args.model)
    proto = source.proto
    steps: list[dict[str, Any]] = []

    def record(name: str, new: Any, **detail: Any) -> Any:
        steps.append(
            {
                "name": name,
                "nodes_before": passes.count_nodes(proto),
                "nodes_after": passes.count_nodes(new),
                **detail,
            }
        )
        return new

    if args.outputs:
        proto = record("extract", passes.extract(proto, [o for o in args.outputs.split(",") if o]))
    if args.rename:
        pairs = [r.partition("=") for r in args.rename]
        if any(not sep or not old or not new for old, sep, new in pairs):
            raise UsageError("--rename expects OLD=NEW")
        proto = record("rename", passes.rename(proto, {old: new for old, _, new in pairs}))
    if args.batch_dynamic:
        result = passes.rewrite_batch(proto)
        unproven = list(result.unproven)
        proto = record(
            "batch_dynamic", result.model, changes=list(result.rewritten), unproven=unproven
        )
    if not args.no_simplify:
        proto = record("simplify", passes.simplify(proto))
    if args.opset is not None:
        proto = record("convert_opset", passes.convert_opset(proto, args.opset), to=args.opset)
    model = load_model(proto)
    out = Path(args.output)
    with atomic_path(out) as tmp:
        model.save(tmp)
    info: dict[str, Any] = {
        "path": str(out),
        "opset": model.opset,
        "inputs": [s.to_json() for s in model.inputs],
        "outputs": [s.to_json() for s in model.outputs],
        "steps": steps,
    }
    if args.batch_dynamic:
        try:
            problems = [str(i) for i in passes.lint_batch(model)]
        except ModelError as exc:  # e.g. it fails outright at another batch size
            problems = [str(exc)]
        info["batch_lint"] = {"passed": not problems, "issues": problems}
    lines = [f"wrote {out} (opset {model.opset})"]
    for st in steps:
        lines.append(f"  {st['name']:<14} {st['nodes_before']} -> {st['nodes_after']} nodes")
        lines += [f"    {c}" for c in st.get("changes", [])]
        lines += [f"    NOT PROVEN: {u}" for u in st.get("unproven", [])]
    lines += [
        f"inputs   {format_specs(info['inputs'])}",
        f"outputs  {format_specs(info['outputs'])}",
    ]
    if "batch_lint" in info:
        lint = info["batch_lint"]
        lines.append("batch lint " + ("ok" if lint["passed"] else "; ".join(lint["issues"])))
    emit(args, info, "\n".join(lines))
    return EXIT_OK
