"""Native libraries' log lines kept off stderr unless the user asked for them (``--verbose``).

ONNX Runtime, TVM and XLA write C++ log lines straight to file descriptor 2 (``[E:onnxruntime:
...]``, TVM's "BlockBuilder destroyed", absl's ``W0000 00:00:...``), also for errors enginekit
handles and reports itself. Verbosity follows the ``enginekit`` logger: at its default
(WARNING) they are kept quiet; ``-v`` (INFO) lets native warnings through, ``-vv`` (DEBUG)
everything.

- :func:`ort_severity` is the ``log_severity_level`` for every ONNX Runtime session enginekit
  creates; :func:`quiet_onnxruntime` also sets ONNX Runtime's default logger.
- :func:`native_stderr` wraps a call into a native library: while it runs, fd 2 goes to a
  temporary file and Python's ``sys.stdout`` to a buffer (TVM's ONNX frontend ``print()``s
  "Error converting operator ..."); afterwards native log lines go to ``logging`` at DEBUG and
  every other line (Python warnings, enginekit's own log records, other output) is written
  where it would have gone.
- :func:`held_output` holds *everything* written during the block (a TensorFlow export, TVM's
  frontend): dropped to the debug log on success, shown on failure.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import re
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator

log = logging.getLogger("enginekit.native")

#: Lines written by native libraries' loggers, kept off stderr unless verbose.
NATIVE_LINE = re.compile(
    r"^\s*(\x1b\[[0-9;]*m)?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[[VIWEF]:onnxruntime:"  # ORT
    r"|^\s*(\x1b\[[0-9;]*m)?\[[VIWEF]:onnxruntime:"
    r"|^[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]"  # absl / glog (XLA, TensorFlow)
    r"|^WARNING: All log messages before absl::InitializeLog"
    r"|BlockBuilder destroyed|Error converting operator|^\[\d\d:\d\d:\d\d\] \S+\.cc:\d+: "  # TVM
)

_lock = threading.Lock()


def verbose() -> bool:
    """Whether the user asked for native libraries' warnings (``enginekit`` logger at INFO)."""
    return logging.getLogger("enginekit").isEnabledFor(logging.INFO)


def ort_severity() -> int:
    """ONNX Runtime ``log_severity_level``: 4 (fatal only) unless verbose; 2 at INFO, 0 at DEBUG."""
    logger = logging.getLogger("enginekit")
    if logger.isEnabledFor(logging.DEBUG):
        return 0
    return 2 if logger.isEnabledFor(logging.INFO) else 4


def quiet_onnxruntime() -> None:
    """Set ONNX Runtime's default logger (used outside sessions) to :func:`ort_severity`."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(ort_severity())


def session_options() -> object:
    """ONNX Runtime SessionOptions with the log severity set (see :func:`ort_severity`)."""
    import onnxruntime

    quiet_onnxruntime()
    so = onnxruntime.SessionOptions()
    so.log_severity_level = ort_severity()
    return so


def filter_native(text: str, what: str) -> str:
    """``text`` without native log lines (logged at DEBUG, tagged with ``what``)."""
    kept = []
    for line in text.splitlines(keepends=True):
        if NATIVE_LINE.search(line):
            log.debug("%s: %s", what, line.rstrip())
        else:
            kept.append(line)
    return "".join(kept)


def _free_native(exc: BaseException) -> None:
    """Let native objects held by the frames of exceptions chained to ``exc`` be freed now,
    while stderr is still redirected: TVM's BlockBuilder warns when it is destroyed, and a
    failed conversion's builder lives as long as the traceback that holds it."""
    seen: set[int] = set()
    todo = [exc.__context__, exc.__cause__]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running
        todo += [e.__context__, e.__cause__]
    gc.collect()


@contextlib.contextmanager
def _captured(stderr_too: bool) -> Iterator[Callable[[], tuple[str, str]]]:
    """Fd 2 to a temporary file and ``sys.stdout`` (and ``sys.stderr`` with ``stderr_too``) to a
    buffer for the block; yields a function giving (printed, native) text once the block ends."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)  # where native libraries write, whatever sys.stderr is now
    printed = io.StringIO()
    native: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(contextlib.redirect_stdout(printed))
                if stderr_too:
                    stack.enter_context(contextlib.redirect_stderr(printed))
                yield lambda: (printed.getvalue(), native[0] if native else "")
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            native.append(tmp.read().decode("utf-8", "replace"))


@contextlib.contextmanager
def native_stderr(what: str) -> Iterator[None]:
    """Keep native log lines written to fd 2 during the block off stderr (unless verbose).

    Args:
        what: what runs (``"building model.onnx on tvm"``), for the DEBUG records.
    """
    if verbose() or not _lock.acquire(blocking=False):  # nested or concurrent: leave it be
        yield
        return
    try:
        texts = None
        try:
            # TVM's ONNX frontend print()s its conversion errors to stdout
            with _captured(stderr_too=False) as texts:
                try:
                    yield
                except BaseException as exc:
                    _free_native(exc)  # while fd 2 is still captured
                    raise
        finally:
            if texts is not None:
                printed, native = texts()
                kept = filter_native(printed, what)
                if kept:
                    sys.stdout.write(kept)
                rest = filter_native(native, what)
                if rest:
                    sys.stderr.write(rest)
                    sys.stderr.flush()
    finally:
        _lock.release()


@contextlib.contextmanager
def held_output(label: str, show_on_error: bool = True) -> Iterator[None]:
    """Hold everything native libraries (TensorFlow's C++ logging, TVM's frontend) and Python
    code under them write to stderr and stdout during the block: dropped to the debug log when
    the block succeeds; when it raises, written back to stderr (``show_on_error``; so a failure
    keeps its context) or to the debug log too (the caller's error says what happened)."""
    try:
        os.fstat(2)
    except OSError:  # no real fd 2 (an embedded interpreter): nothing to capture
        yield
        return
    ok = False
    texts = None
    try:
        with _captured(stderr_too=True) as texts:
            yield
        ok = True
    finally:
        if texts is not None:
            text = "".join(texts())
            if text and (ok or not show_on_error):
                log.debug("%s: output held back:\n%s", label, text.rstrip())
            elif text:
                sys.stderr.write(text)
