"""Progress of long work: a live line on a TTY, ``logging`` records otherwise."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

log = logging.getLogger("enginekit")


def _tty() -> bool:
    return sys.stderr.isatty() and os.environ.get("ENGINEKIT_QUIET") != "1"


@contextlib.contextmanager
def step(label: str) -> Iterator[None]:
    """Report the start and end (with elapsed time) of one stage of long work."""
    start = time.perf_counter()
    tty = _tty()
    if tty:
        sys.stderr.write(f"… {label}\r")
        sys.stderr.flush()
    log.info("%s ...", label)
    try:
        yield
    except BaseException:
        if tty:
            sys.stderr.write(f"✗ {label} ({time.perf_counter() - start:.1f} s)\n")
        raise
    elapsed = time.perf_counter() - start
    if tty:
        sys.stderr.write(f"✓ {label} ({elapsed:.1f} s)\n")
    log.info("%s done in %.2f s", label, elapsed)
