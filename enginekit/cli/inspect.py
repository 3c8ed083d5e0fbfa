"""``enginekit inspect`` (an ONNX model or an engine artifact) and ``enginekit backends``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from enginekit.cli.common import EXIT_OK, emit, format_specs, max_abs

# -- inspect -----------------------------------------------------------------------------------


def add_inspect(sub: Any) -> None:
    """Register ``enginekit inspect``."""
    p = sub.add_parser("inspect", help="describe an ONNX model or an engine artifact")
    p.add_argument("path")
    p.add_argument("--ir", action="store_true", help="include the backend's compiled IR summary")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


def inspect_model(path: str) -> dict[str, Any]:
    """IO specs, opset, op counts, hash, and the batch lint of an ONNX model."""
    from collections import Counter

    from enginekit.errors import EnginekitError
    from enginekit.model import load_model
    from enginekit.passes import lint_batch

    model = load_model(path)
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
            # other symbolic dims (a sequence length) get a small size: the lint is about batch
            others = {d for spec in model.inputs for d in spec.shape[1:] if isinstance(d, str)} - {
                model.inputs[0].shape[0]
            }
            issues = lint_batch(model, dims=dict.fromkeys(others, 4))
            info["batch_lint"] = {"passed": not issues, "issues": [str(i) for i in issues]}
        except EnginekitError as exc:
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


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the description of a model or an artifact (whichever the path holds)."""
    from enginekit.artifact import MANIFEST

    p = Path(args.path)
    is_artifact = (
        (p.is_dir() and (p / MANIFEST).exists())
        or p.suffix == ".ekit"  # a broken one gets the artifact reader's "truncated or corrupt"
        or (p.is_file() and p.suffix != ".onnx" and _is_zip(p))
    )
    if is_artifact:
        info = inspect_artifact(args.path, ir=args.ir)
        verify = info.get("verify") or {}
        lines = [
            f"artifact   {args.path} (format {info['format_version']}, enginekit {info['enginekit_version']})",
            f"backend    {info['backend']['name']} {info['backend']['version']}"
            + _metadata_text(info["backend"].get("metadata") or {}),
            f"precision  {info['precision']}   device {info['config']['device']}",
            f"inputs     {format_specs(info['inputs'])}",
            f"outputs    {format_specs(info['outputs'])}",
            f"profiles   {_profiles_text(info['profiles']) or 'none (any size)'}",
            f"source     sha256 {info['source']['sha256'][:16]}… opset {info['source']['opset']} {info['source'].get('path') or ''}",
            f"target     {info['target'].get('kind', 'cpu')} {info['target'].get('cpu', '')}",
            f"built      {info['build']['created']} in {info['build']['build_s']} s; key {info['build_key'][:16]}…",
            "verified   "
            + (
                f"{'passed' if verify['passed'] else 'FAILED'}, max abs error {max_abs(verify):.3g}"
                if verify
                else "no"
            ),
            "payload    " + ", ".join(f"{n} ({e['size']} B)" for n, e in info["payload"].items()),
            "passes     " + (", ".join(map(_pass_text, info.get("passes", []))) or "none"),
        ]
        lines += _int8_lines(info)
        for key, value in (info.get("backend_details") or {}).items():
            lines.append(f"{key:<10} {value}")
    else:
        info = inspect_model(args.path)
        lines = [
            f"model      {args.path} (opset {info['opset']}, {info['producer'] or 'unknown producer'})",
            f"sha256     {info['sha256']}",
            f"inputs     {format_specs(info['inputs'])}",
            f"outputs    {format_specs(info['outputs'])}",
            f"nodes      {info['nodes']} ({', '.join(f'{k} {v}' for k, v in info['ops'].items())})",
        ]
        lint = info.get("batch_lint")
        if lint:
            verdict = "ok" if lint["passed"] else "PROBLEMS: " + "; ".join(lint["issues"])
            lines.append(f"batch lint {verdict}")
    emit(args, info, "\n".join(lines))
    return EXIT_OK


def _metadata_text(metadata: dict[str, Any]) -> str:
    """The backend's own facts as ``key=value``; None values and what other lines show (shapes,
    layout of the inputs) are left out."""
    items = [
        f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in metadata.items()
        if v is not None and k not in ("shapes", "inputs", "outputs") and not isinstance(v, dict)
    ]
    return f" ({'; '.join(items)})" if items else ""


def _pass_text(p: dict[str, Any]) -> str:
    if p.get("skipped"):
        return f"{p['name']} skipped ({p['skipped']})"
    return f"{p['name']} {p['nodes_before']}->{p['nodes_after']} nodes"


def _int8_lines(info: dict[str, Any]) -> list[str]:
    """Calibration and the agreement on data of an int8 artifact."""
    lines = []
    cal = info.get("calibration") or {}
    if cal:
        lines.append(
            f"calibration {cal.get('method')} on {cal.get('samples')} samples, "
            f"{cal.get('tensors')} tensors (table {str(cal.get('sha256', ''))[:12]}…)"
        )
    verify = info.get("verify") or {}
    if verify.get("kind") == "accuracy":
        for name, o in (verify.get("outputs") or {}).items():
            top1 = o.get("top1_agreement")
            lines.append(
                f"agreement  {name}: max abs {o.get('max_abs', 0):.3g}, mean abs "
                f"{o.get('mean_abs', 0):.3g}"
                + (f", top-1 {top1:.2%}" if top1 is not None else "")
                + f" on {o.get('rows')} rows of {verify.get('data')} vs {verify.get('reference')}"
            )
    return lines


def _is_zip(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _profiles_text(profiles: list[dict[str, Any]]) -> str:
    return " ".join(
        f"{n}:{','.join('x'.join(map(str, s)) for s in v)}" for p in profiles for n, v in p.items()
    )


# -- backends ----------------------------------------------------------------------------------


def add_backends(sub: Any) -> None:
    """Register ``enginekit backends``."""
    p = sub.add_parser(
        "backends",
        help="list backends: installed, versions, devices, why not",
        description="Fast by default: a backend that names its packages is answered from their "
        "metadata, without importing its framework; --check imports each one and probes its "
        "devices.",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--check", action="store_true", help="import every framework and probe its devices"
    )
    p.add_argument(
        "--ops", action="store_true", help="also list each backend's supported ONNX ops (imports)"
    )
    p.set_defaults(func=cmd_backends)


def cmd_backends(args: argparse.Namespace) -> int:
    """One line per registered backend: version, devices and precisions, or why not."""
    from enginekit import backends

    probe = args.check or args.ops
    rows = []
    for name in backends.names():
        avail = backends.availability(name) if probe else backends.quick_availability(name)
        row = avail.to_json()
        module = backends.get(name)
        row["options"] = dict(getattr(module, "OPTIONS", {}))
        kinds = [d.split(":")[0] for d in avail.devices] or ["cpu"]
        offered = {p for kind in kinds for p in backends.precisions(module, kind)}
        row["precisions"] = [p for p in backends.precisions(module, "any") if p in offered]
        if not avail.probed:
            row["precisions"] = list(getattr(module, "PRECISIONS", ("fp32",)))
        ops = getattr(module, "supported_ops", None)
        if args.ops and ops is not None:
            row["supported_ops"] = ops()
        rows.append(row)
    lines = []
    for r in rows:
        precs = f"precisions: {', '.join(r['precisions'])}"
        if r["available"] and r["probed"]:
            lines.append(
                f"{r['name']:<12} {r['version']:<14} devices: {', '.join(r['devices'])}; {precs}"
            )
        elif r["available"]:
            lines.append(f"{r['name']:<12} {r['version']:<14} {precs}; {r['reason']}")
        else:
            lines.append(f"{r['name']:<12} {'unavailable':<14} {r['reason']}")
        if args.ops and r.get("supported_ops"):
            lines.append(_ops_text(r["supported_ops"]))
    emit(args, rows, "\n".join(lines))
    return EXIT_OK


def _ops_text(ops: list[str], width: int = 100) -> str:
    """An op list wrapped and indented under its backend's line."""
    import textwrap

    body = textwrap.fill(", ".join(ops), width=width, initial_indent="  ", subsequent_indent="  ")
    return f"  {len(ops)} ONNX ops:\n{body}"
