"""``enginekit --help`` and every subcommand's ``--help`` stay as they were saved in help/.

The texts were saved before the command line became a package; a change to a flag or its help
shows here as a diff. After an intended change (or a new command), regenerate them:
``python tests/cli/test_help.py`` (writes help/*.txt; or ``... DIR`` to write them elsewhere)
and review the diff.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELP = Path(__file__).parent / "help"
#: argparse wraps to the terminal width; the saved texts are at this one.
COLUMNS = "100"

pytestmark = pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="the help texts were saved with Python 3.11's argparse, whose layout later versions change",
)


def _help(path: list[str]) -> str:
    from enginekit.cli import parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            parser().parse_args([*path, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, f"enginekit {' '.join(path)} --help exited {exc.code}"
    return out.getvalue()


def commands() -> list[list[str]]:
    """Every command path of the parser: [], [build], ..., [cache, prune]."""
    from enginekit.cli import parser

    found: list[list[str]] = []

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        found.append(path)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, [*path, name])

    walk(parser(), [])
    return found


def _file(path: list[str], folder: Path = HELP) -> Path:
    return folder / ("-".join(["enginekit", *path]) + ".txt")


def test_every_command_has_a_saved_help_text(monkeypatch):
    monkeypatch.setenv("COLUMNS", COLUMNS)
    saved = {p.name for p in HELP.glob("*.txt")}
    current = {_file(path).name for path in commands()}
    assert current == saved, f"new commands: {current - saved}; gone: {saved - current}"


@pytest.mark.parametrize("path", commands(), ids=lambda p: " ".join(["enginekit", *p]))
def test_help_text_is_unchanged(path, monkeypatch):
    monkeypatch.setenv("COLUMNS", COLUMNS)
    assert _help(path) == _file(path).read_text()


def test_regenerating_writes_the_saved_texts(tmp_path):
    script = Path(__file__)
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    written = {p.name: p.read_text() for p in tmp_path.glob("*.txt")}
    assert written == {p.name: p.read_text() for p in HELP.glob("*.txt")}


def write(folder: Path) -> None:
    """Write every command's help text into ``folder``."""
    os.environ["COLUMNS"] = COLUMNS
    folder.mkdir(parents=True, exist_ok=True)
    for path in commands():
        _file(path, folder).write_text(_help(path))
    print(f"wrote {len(commands())} help texts to {folder}", file=sys.stderr)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HELP)
