"""What every command of the ``enginekit`` command line shares: exit codes, output (``--json``,
GitHub annotations), ``-O key=value`` options, input files, the trtexec shape syntax,
candidates. It imports no command module; command modules import it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from enginekit.errors import UsageError
from enginekit.files import atomic_write

#: Exit codes: ok, failure (a typed enginekit error), usage error (UsageError, from here or the
#: library), verification or a gate failed.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_VERIFY = 0, 1, 2, 3


# -- output --------------------------------------------------------------------------------------


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON with ``--json``, else ``text``."""
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def add_json_report(p: argparse.ArgumentParser) -> None:
    """``--json`` (the report to stdout instead of the table) and ``--json-file PATH`` (the
    report written there, the table still printed): a flag never takes the next word."""
    p.add_argument(
        "--json", action="store_true", help="print the JSON report to stdout instead of the table"
    )
    p.add_argument(
        "--json-file",
        metavar="PATH",
        help="write the JSON report to PATH (the table is still printed)",
    )


def report(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print the table, or the JSON report (``--json``); ``--json-file PATH`` also writes it."""
    if args.json_file is not None:
        with atomic_write(args.json_file, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    print(json.dumps(data, indent=2) if args.json else text)


def github() -> bool:
    """Whether this runs in GitHub Actions (problems are then also annotated on the file)."""
    return os.environ.get("GITHUB_ACTIONS") == "true"


def annotate(level: str, message: str, file: str | None = None, line: int | None = None) -> None:
    """A GitHub Actions workflow command, so the problem shows on the file in the PR."""
    where = ",".join(
        p for p in (f"file={file}" if file else "", f"line={line}" if line else "") if p
    )
    text = message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    print(f"::{level} {where}::{text}" if where else f"::{level}::{text}")


def config_errors(exc: Any) -> int:
    """Print every problem of an invalid build file (a ConfigError); returns exit code 2."""
    for issue in exc.issues:
        print(issue.format(exc.path), file=sys.stderr)
        if github():
            annotate("error", issue.message, str(exc.path), issue.line)
    return EXIT_USAGE


def max_abs(report: dict[str, Any]) -> float:
    """The largest absolute error anywhere in a verification report."""
    values = [o.get("max_abs", 0.0) for c in report.get("cases", []) for o in c["outputs"].values()]
    values += [o.get("max_abs", 0.0) for o in report.get("outputs", {}).values()]
    return max(values, default=0.0)


# -- values --------------------------------------------------------------------------------------


def parse_option(text: str) -> tuple[str, Any]:
    """``-O key=value``: the value parsed as JSON when it is JSON, else kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"-O {text!r}: expected key=value (value in JSON, or a plain string)")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def ints(text: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: expected integers separated by commas, e.g. 1,8,32"
        ) from None


def names(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


# -- shapes (trtexec syntax) -----------------------------------------------------------------------


def add_shapes(p: argparse.ArgumentParser, help: str) -> None:
    """``--shapes name:AxB | name:min,opt,max ...``, repeatable."""
    p.add_argument("--shapes", action="append", nargs="+", default=[], metavar="SPEC", help=help)


def shapes(args: argparse.Namespace) -> Any:
    """The profiles ``--shapes`` gives, or None when it was not given."""
    from enginekit.config import parse_shapes

    specs = [s for group in args.shapes for s in group]
    return parse_shapes(specs) if specs else None


# -- input files ---------------------------------------------------------------------------------


def add_inputs(p: argparse.ArgumentParser, help: str) -> None:
    """``--input/-i NAME=FILE.npy | FILE.npz``, repeatable; read with :func:`load_inputs`."""
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="NAME=FILE.npy|FILE.npz",
        help=help,
    )


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


def save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to an ``.npz``, atomically."""
    with atomic_write(path, suffix=".npz") as f:
        cast(Any, np.savez)(f, **arrays)  # numpy stubs type **kwds as bool


def format_specs(specs: list[dict[str, Any]]) -> str:
    """``x: float32[batchx16], y: int64[scalar]`` from TensorSpec JSON."""
    return ", ".join(
        f"{s['name']}: {s['dtype']}[{'x'.join(map(str, s['shape'])) or 'scalar'}]" for s in specs
    )


# -- candidates (compare, build --backend auto) --------------------------------------------------


def add_candidate(p: Any) -> None:
    """``--candidate NAME [KEY=VALUE ...]``, repeatable."""
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


def parse_candidate(tokens: list[str]) -> Any:
    """``NAME [KEY=VALUE ...]`` as a Candidate; keys ``precision``, ``model`` and ``label`` are
    the candidate's own, every other key a backend option (values parsed as JSON when they are)."""
    from enginekit.evaluate.candidates import Candidate

    name, *rest = tokens
    fields: dict[str, Any] = {}
    options = {}
    for token in rest:
        if "=" not in token:
            raise UsageError(
                f"--candidate {' '.join(tokens)}: {token!r} is not KEY=VALUE (a positional "
                "argument such as the model goes before --candidate)"
            )
        key, value = parse_option(token)
        if key in ("precision", "model", "label"):
            fields[key] = str(value)
        else:
            options[key] = value
    return Candidate(name, options, **fields)
