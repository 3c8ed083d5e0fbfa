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


@contextlib.contextmanager
def native_output_captured(label: str, show_on_error: bool = True) -> Iterator[None]:
    """Hold what native libraries (TensorFlow's C++ logging, TVM's frontend) and Python code
    under them write to stderr and stdout during the block: dropped to the debug log when the
    block succeeds; when it raises, written back to stderr (``show_on_error``; so a failure keeps
    its context) or to the debug log too (the caller's error says what happened)."""
    import tempfile

    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no real fd 2 (an embedded interpreter): nothing to capture
        yield
        return
    import io

    printed = io.StringIO()
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        ok = False
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = printed.getvalue() + sink.read().decode("utf-8", errors="replace")
            if text and (ok or not show_on_error):
                log.debug("%s: output held back:\n%s", label, text.rstrip())
            elif text:
                sys.stderr.write(text)
