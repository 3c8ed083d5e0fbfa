"""The typed errors enginekit raises; every message says what to do next."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class EnginekitError(Exception):
    """Base of every error enginekit raises on purpose."""


class ModelError(EnginekitError):
    """An ONNX model cannot be read or is unsafe to read (bad file, escaping external data)."""


class ExportError(EnginekitError):
    """A framework model could not be exported to ONNX, or the export does not match it."""


class BuildError(EnginekitError):
    """An engine could not be built from a model and a BuildConfig."""


class VerificationError(BuildError):
    """A built engine disagrees with the reference past the tolerance (CLI exit code 3)."""

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


class EngineInputError(EnginekitError, ValueError):
    """An input given to Engine.infer does not match the engine's input specs."""


class ArtifactError(EnginekitError):
    """An engine artifact is missing, corrupt, from another format version or for another host."""


class BackendUnavailable(EnginekitError):
    """A backend is not installed, or has no device it can run on here."""


class CalibrationError(BuildError):
    """Calibration data or a calibration table is unusable: wrong inputs, empty, other model."""


class UsageError(EnginekitError, ValueError):
    """Arguments that are out of range or cannot work together (CLI exit code 2)."""


class BatcherError(EnginekitError):
    """A request to a Batcher could not be served (queue full, deadline passed, closed)."""


class QueueFull(BatcherError):
    """A Batcher's queue holds ``max_queue`` requests already: back off, or shed load."""


class DeadlineExceeded(BatcherError, TimeoutError):
    """A request's ``timeout_ms`` passed while it waited in a Batcher's queue."""


class BatcherClosed(BatcherError):
    """A Batcher was closed: it accepts no request, and ``close(drain=False)`` fails queued ones."""


class DatasetError(EnginekitError):
    """A dataset job cannot run: a source or output is unreadable, mismatched or already there,
    or a resume would mix results of another model or source."""


class UnknownBackend(BackendUnavailable, UsageError):
    """No backend of that name is registered: a typo, not a missing install (CLI exit code 2)."""


def closest(name: str, choices: Iterable[str], n: int = 1) -> list[str]:
    """The names in ``choices`` closest to ``name`` (a typo's likely intent), best first."""
    pool = sorted(set(choices))
    close = difflib.get_close_matches(name, pool, n=n)
    if not close:  # a prefix or a case slip that difflib's ratio misses: 'onnx', 'TVM'
        close = [c for c in pool if c.lower().startswith(name.lower()) and name][:n]
    return close


def did_you_mean(name: str, choices: Iterable[str], n: int = 1) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = closest(name, choices, n)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
