"""Helpers of the CI pipeline tests: the project folder, the CLI in a subprocess, shapes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent.parent

#: [shapes] of the MLP test model (x: [batch, 16]).
MLP_SHAPES = '[shapes]\nx = ["1x16", "4x16", "8x16"]\n'


class Project:
    """A folder with ``mlp.onnx``; ``write(toml)`` writes ``enginekit.toml`` there."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, text: str, name: str = "enginekit.toml") -> Path:
        path = self.root / name
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
        return path


def cli(
    *args: str, cwd: Path | None = None, prelude: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The enginekit command in a fresh process (exit codes are what a CI job sees)."""
    # The checkout under test comes first, whatever the working directory.
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS.parent)!r}, {str(TESTS)!r}]; {prelude}"
        "from enginekit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env=env,
    )


#: Registers the deliberately broken test backend (tests/broken_backend.py) in a subprocess.
BROKEN = "from enginekit.backends import _BUILTIN; _BUILTIN['broken'] = 'broken_backend'; "
