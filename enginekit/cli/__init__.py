"""The ``enginekit`` command line: build, run, infer, inspect, backends, compare, bench, profile,
validate, cache, export-triton, export, prepare, calibrate.

One module per command group (``build``; ``run``; ``infer``; ``inspect`` and ``backends``;
``compare`` and ``bench`` in :mod:`~enginekit.cli.evaluate`; ``profile``; ``export`` and
``prepare``; ``calibrate``; the
pipeline commands), each registering its commands with a function listed in :data:`COMMANDS`;
what they share (exit codes, ``--json``, ``-O``, inputs, shapes) is :mod:`enginekit.cli.common`.

Exit codes: 0 ok, 1 failure (a typed enginekit error), 2 usage error (with ``build -c``: an
invalid build file or baseline), 3 verification failed (with ``build -c``: a gate failed —
accuracy, top-1 agreement, throughput regression — or an engine failed verification).
Every command that prints a result takes ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from enginekit.cli import (
    build,
    calibrate,
    evaluate,
    export,
    infer,
    inspect,
    pipeline,
    profile,
    run,
)
from enginekit.cli.common import EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY
from enginekit.errors import EnginekitError, UsageError, VerificationError
from enginekit.version import __version__

#: Subcommand registrars, in the order ``enginekit --help`` lists the commands; a new command
#: group adds its module's registrars here.
COMMANDS: list[Callable[[Any], None]] = [
    build.add,
    run.add,
    infer.add,
    inspect.add_inspect,
    inspect.add_backends,
    evaluate.add_compare,
    evaluate.add_bench,
    profile.add,
    pipeline.add_validate,
    pipeline.add_cache,
    pipeline.add_export_triton,
    export.add_export,
    export.add_prepare,
    calibrate.add,
]


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``enginekit`` command."""
    p = argparse.ArgumentParser(
        prog="enginekit",
        description="Turn trained models into fast, verified inference engines.",
        epilog="exit codes: 0 ok, 1 failure, 2 usage error (or invalid build file), 3 "
        "verification or a build -c gate failed",
    )
    p.add_argument("--version", action="version", version=f"enginekit {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return p


def _unrecognized(p: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit with the usage of the (sub)command the unknown arguments were given to, and the
    closest flag it has for each of them (``--backnd`` -> ``--backend``)."""
    from enginekit.errors import closest

    command = p
    while command._subparsers is not None:
        action = next(
            a
            for a in command._subparsers._group_actions
            if isinstance(a, argparse._SubParsersAction)
        )
        chosen = getattr(args, action.dest or "", None)
        if chosen not in action.choices:
            break
        command = action.choices[chosen]
    flags = [o for o in command._option_string_actions if o.startswith("--")]
    hints = []
    for extra in extras:
        if extra.startswith("-"):
            close = closest(extra.split("=")[0], flags)
            if close:
                hints.append(f"{extra.split('=')[0]}: did you mean {close[0]}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``enginekit`` console script; returns the exit code."""
    p = parser()
    args, extras = p.parse_known_args(argv)
    if extras:
        _unrecognized(p, args, extras)
    level = (
        logging.WARNING
        if args.verbose == 0
        else logging.INFO
        if args.verbose == 1
        else logging.DEBUG
    )
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
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
