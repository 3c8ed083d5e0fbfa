"""``enginekit run``: one batch from ``.npy``/``.npz`` files through an engine artifact."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from enginekit.cli.common import EXIT_OK, add_inputs, emit, load_inputs, save_npz
from enginekit.errors import UsageError


def add(sub: Any) -> None:
    """Register ``enginekit run``."""
    p = sub.add_parser("run", help="run an engine artifact on inputs from .npy/.npz files")
    p.add_argument("artifact")
    add_inputs(p, "inputs")
    p.add_argument("-o", "--output", help="write outputs to this .npz")
    p.add_argument("--device", help="override the artifact's device")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the inputs once; print each output's shape, dtype and range (and the time)."""
    from enginekit.backends import load

    if not args.input:
        raise UsageError("run needs --input name=file.npy (repeat per input) or --input inputs.npz")
    feeds = load_inputs(args.input)
    with load(args.artifact, device=args.device) as engine:
        start = time.perf_counter()
        outputs = engine.infer(feeds)
        elapsed = time.perf_counter() - start
    if args.output:
        save_npz(args.output, outputs)
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
    emit(args, {"outputs": summary, "seconds": elapsed, "written": args.output}, "\n".join(lines))
    return EXIT_OK
