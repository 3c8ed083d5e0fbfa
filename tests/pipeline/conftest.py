"""Fixtures of the CI pipeline tests (helpers live in helpers.py; this folder is a package so
that its conftest does not take the place of tests/conftest.py as the module ``conftest``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import Project


@pytest.fixture
def project(tmp_path: Path, mlp_path: Path) -> Project:
    """A folder holding the tiny MLP as mlp.onnx; ``project.write(toml)`` writes the build file."""
    import shutil

    shutil.copy(mlp_path, tmp_path / "mlp.onnx")
    return Project(tmp_path)


@pytest.fixture
def broken_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Registers tests/broken_backend.py, whose engines disagree with the reference."""
    from enginekit import backends

    monkeypatch.setitem(backends._BUILTIN, "broken", "broken_backend")
    return lambda: None
