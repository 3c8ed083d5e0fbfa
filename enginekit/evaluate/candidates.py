"""Candidates: one way to build an engine (backend, options, precision, optional model variant),
and whether it can be built here. Shared by :mod:`enginekit.evaluate.compare` and :mod:`enginekit.evaluate.choose`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from enginekit import backends as registry
from enginekit.config import Precision
from enginekit.errors import UsageError
from enginekit.model import ModelSource


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to build an engine: a backend, its options, a precision, and optionally a model
    variant (an equivalent model, e.g. simplified or re-exported) to build from instead.

    Verification always holds it to the reference of the main model.
    """

    backend: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    precision: str = "fp32"
    model: ModelSource | None = None
    label: str = ""

    def __post_init__(self) -> None:
        registry.check_name(self.backend)  # a typo is a usage error, not a skipped candidate
        object.__setattr__(self, "options", dict(self.options))
        try:
            object.__setattr__(self, "precision", Precision(self.precision).value)
        except ValueError:
            raise UsageError(
                f"candidate {self.backend!r}: precision {self.precision!r} is not one of "
                f"{', '.join(p.value for p in Precision)}"
            ) from None
        if not self.label:
            object.__setattr__(self, "label", self._default_label())

    def _default_label(self) -> str:
        extras = [] if self.precision == "fp32" else [self.precision]
        extras += [f"{k}={v}" for k, v in self.options.items()]
        if self.model is not None:
            extras.append(f"model={Path(str(getattr(self.model, 'path', None) or 'variant')).name}")
        return self.backend + (f"[{', '.join(extras)}]" if extras else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "backend": self.backend,
            "precision": self.precision,
            "options": dict(self.options),
            "model": None if self.model is None else str(getattr(self.model, "path", self.model)),
        }


def as_candidate(entry: str | Candidate | tuple[Any, ...]) -> Candidate:
    """A Candidate from a backend name, ``(backend, options)`` or ``(backend, options, precision)``."""
    if isinstance(entry, Candidate):
        return entry
    if isinstance(entry, str):
        return Candidate(entry)
    if isinstance(entry, tuple) and 1 <= len(entry) <= 3 and isinstance(entry[0], str):
        return Candidate(*entry)
    raise UsageError(
        f"candidate {entry!r}: expected a backend name, (backend, options[, precision]) or a "
        "Candidate"
    )


def skip_reason(candidate: Candidate, device: str) -> str | None:
    """Why ``candidate`` cannot be built here (not installed, no such device, precision not
    offered), or None when it can. (An unregistered name never gets this far: the Candidate
    refuses it as a usage error.)"""
    name = candidate.backend
    avail = registry.availability(name)
    if not avail.available:
        return avail.reason or "not available"
    kind = device.split(":")[0]
    if not any(d.split(":")[0] == kind for d in avail.devices):
        return f"no {device!r} device (it has: {', '.join(avail.devices) or 'none'})"
    offered = registry.precisions(registry.get(name), device)
    if candidate.precision not in offered:
        return (
            f"precision {candidate.precision} not offered on {device} (it builds "
            f"{', '.join(offered)} there)"
        )
    return None
