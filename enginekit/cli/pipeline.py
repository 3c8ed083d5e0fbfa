"""The commands around CI pipelines besides ``build -c``: ``validate`` (a build file),
``cache`` (the artifact cache of ``build -c``) and ``export-triton`` (a Triton model repository
entry)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from enginekit.cli.common import EXIT_OK, EXIT_USAGE, annotate, config_errors, github
from enginekit.errors import UsageError

# -- validate ------------------------------------------------------------------------------------


def add_validate(sub: Any) -> None:
    """Register ``enginekit validate``."""
    p = sub.add_parser("validate", help="check a build file (enginekit.toml) without building")
    p.add_argument("-c", "--config", default="enginekit.toml", metavar="TOML")
    p.add_argument(
        "--schema", action="store_true", help="print the build file's JSON Schema and exit"
    )
    p.add_argument("--strict", action="store_true", help="treat warnings as errors")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    """Exit 0 when the file is valid (warnings printed), 2 with every problem otherwise."""
    from enginekit.pipeline.config import ConfigError, load
    from enginekit.pipeline.spec import json_schema

    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return EXIT_OK
    try:
        cfg = load(args.config, strict=args.strict)
    except ConfigError as exc:
        if args.json:
            print(
                json.dumps({"valid": False, "issues": [i.to_json() for i in exc.issues]}, indent=2)
            )
            if github():
                for i in exc.issues:
                    annotate("error", i.message, str(exc.path), i.line)
            return EXIT_USAGE
        return config_errors(exc)
    for w in cfg.warnings:
        print("warning: " + w.format(cfg.path), file=sys.stderr)
        if github():
            annotate("warning", w.message, str(cfg.path), w.line)
    if args.json:
        data = {
            "valid": True,
            "entries": [e.to_json() for e in cfg.entries],
            "warnings": [w.to_json() for w in cfg.warnings],
        }
        print(json.dumps(data, indent=2))
    else:
        print(f"{cfg.path}: valid, {len(cfg.entries)} entries")
        for e in cfg.entries:
            print(f"  {e.id}.ekit")
    return EXIT_OK


# -- cache ---------------------------------------------------------------------------------------


def add_cache(sub: Any) -> None:
    """Register ``enginekit cache info`` and ``enginekit cache prune``."""
    p = sub.add_parser("cache", help="inspect or prune the artifact cache of build -c")
    csub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    for name, helptext in (
        ("info", "entries and size of the cache"),
        ("prune", "remove least recently used entries"),
    ):
        q = csub.add_parser(name, help=helptext)
        q.add_argument(
            "--cache",
            default=os.environ.get("ENGINEKIT_CACHE"),
            metavar="DIR",
            help="the cache folder (default $ENGINEKIT_CACHE)",
        )
        q.add_argument("--json", action="store_true")
        if name == "prune":
            q.add_argument(
                "--max-size", help="keep at most this much, e.g. 5GB (10^9) or 5GiB (2^30)"
            )
            q.add_argument("--max-age", help="remove entries unused for longer, e.g. 30d, 12h")
            q.add_argument("--dry-run", action="store_true", help="list what would be removed")
        q.set_defaults(func=cmd_cache)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def cmd_cache(args: argparse.Namespace) -> int:
    """``info``: what the cache holds; ``prune``: remove least recently used entries."""
    from enginekit.pipeline.cache import Cache, parse_age, parse_size

    if not args.cache:
        raise UsageError("give --cache DIR (or set ENGINEKIT_CACHE)")
    cache = Cache(args.cache)
    if args.cache_command == "info":
        entries = cache.entries()
        total = sum(e.size for e in entries)
        data = {
            "cache": str(cache.root),
            "entries": len(entries),
            "bytes": total,
            "items": [
                {"key": e.key, "size": e.size, "last_used": e.last_used, **e.meta} for e in entries
            ],
        }
        lines = [f"{cache.root}: {len(entries)} entries, {_size(total)}"]
        lines += [f"  {e.key[:16]}…  {_size(e.size):>9}  {e.meta.get('id', '')}" for e in entries]
        print(json.dumps(data, indent=2) if args.json else "\n".join(lines))
        return EXIT_OK
    if args.max_size is None and args.max_age is None:
        raise UsageError("prune needs --max-size and/or --max-age")
    try:
        max_size = parse_size(args.max_size) if args.max_size is not None else None
        max_age = parse_age(args.max_age) if args.max_age is not None else None
    except Exception as exc:
        raise UsageError(str(exc)) from None
    result = cache.prune(max_size, max_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    text = (
        f"{cache.root}: {verb} {len(result.removed)} entries ({_size(result.freed)}), kept "
        f"{len(result.kept)} ({_size(sum(e.size for e in result.kept))})"
        + (f"; {len(result.busy)} in use by a running job, kept" if result.busy else "")
    )
    print(
        json.dumps({**result.to_json(), "dry_run": args.dry_run}, indent=2) if args.json else text
    )
    return EXIT_OK


# -- export-triton -------------------------------------------------------------------------------


def add_export_triton(sub: Any) -> None:
    """Register ``enginekit export-triton``."""
    p = sub.add_parser(
        "export-triton", help="write a Triton Inference Server model repository entry"
    )
    p.add_argument("artifact", help="engine artifact (.ekit)")
    p.add_argument("--repo", required=True, metavar="DIR", help="model repository folder")
    p.add_argument("--name", help="Triton model name (default: the artifact's file stem)")
    p.add_argument("--version", type=int, default=1, help="version folder (default 1)")
    p.add_argument("--max-batch-size", type=int, help="default: the profiles' largest batch")
    p.add_argument(
        "--max-queue-delay-us", type=int, default=100, help="dynamic batching queue delay"
    )
    p.add_argument("--instances", type=int, default=1, help="model instances (default 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export_triton)


def cmd_export_triton(args: argparse.Namespace) -> int:
    """Write the model repository entry; print its files and notes."""
    from enginekit.pipeline.triton import export_triton

    result = export_triton(
        args.artifact,
        args.repo,
        name=args.name,
        version=args.version,
        max_batch_size=args.max_batch_size,
        max_queue_delay_us=args.max_queue_delay_us,
        instance_count=args.instances,
    )
    kind = result["platform"] or f"{result['backend']} backend"
    lines = [f"wrote {result['model_dir']} ({kind}, max_batch_size {result['max_batch_size']})"]
    lines += [f"  {f}" for f in result["files"]]
    lines += [f"note: {n}" for n in result["notes"]]
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines))
    return EXIT_OK
