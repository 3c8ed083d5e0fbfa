"""A backend registered through the ``enginekit.backends`` entry-point group (the dist-info
beside this file) that is never available: the "registered here but not installed" case.

Tests put this folder on ``sys.path`` (or PYTHONPATH) to register it.
"""

from __future__ import annotations

from enginekit.backends import Availability

NAME = "absent"
OPTIONS: dict[str, str] = {}
PRECISIONS = ("fp32", "int8")


def available() -> Availability:
    return Availability(
        NAME, False, reason="the absent runtime is not installed (pip install absent)"
    )


def build(model, config, workdir):  # pragma: no cover - never available
    raise AssertionError("an unavailable backend is never asked to build")


def load(artifact, device):  # pragma: no cover
    raise AssertionError("an unavailable backend is never asked to load")
