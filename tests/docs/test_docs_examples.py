"""Every example in README.md and docs/ runs as written.

Each page's fenced ```python, ```bash/```sh and ```console blocks (in a console block, the lines
starting with ``$ ``, with their ``\\`` continuation lines) run in order in one fresh folder that
holds the fixture files of doc_fixtures.py; the page's Python blocks share one namespace (which
starts with the fixture names), shell blocks run through bash with this venv's ``bin`` first on
PATH and this checkout's enginekit importable. A block preceded by a line
``<!-- no-run: reason -->`` is skipped (a GPU, TensorRT, the network, a long run). A new page
under docs/ is picked up automatically.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import doc_fixtures
import pytest

ROOT = Path(__file__).parents[2]
RUNNABLE = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
            "console": "console"}  # fmt: skip
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    kind: str  # python, shell or console
    code: str
    skip: str | None  # the no-run reason


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The runnable fenced blocks of one Markdown page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start, body, i = i, [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang not in RUNNABLE:
            continue
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = NO_RUN.match(prev.strip())
        code = "\n".join(body) + "\n"
        if RUNNABLE[lang] == "console":
            code = _console_commands(body)
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        out.append(Block(name, start + 1, RUNNABLE[lang], code, skip.group(1) if skip else None))
    return out


def _console_commands(body: list[str]) -> str:
    """The ``$ `` lines of a console block (and their continuation lines); output is dropped."""
    commands, continued = [], False
    for line in body:
        if line.startswith("$ ") or continued:
            text = line[2:] if line.startswith("$ ") and not continued else line
            commands.append(text)
            continued = text.rstrip().endswith("\\")
    return "\n".join(commands) + "\n"


PAGES = [p for p in pages() if any(b.skip is None for b in blocks(p))]


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return doc_fixtures.build(tmp_path_factory.mktemp("doc-fixtures"))


def _shell_env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(folder)])
    env["ENGINEKIT_QUIET"] = "1"
    env.pop("GITHUB_STEP_SUMMARY", None)
    return env


def run_page(path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run a page's blocks in ``folder``; returns what ran (page:line kind)."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))  # my_models.py, train.py for Python blocks
    namespace = doc_fixtures.namespace()
    ran = []
    for block in blocks(path):
        where = f"{block.page}:{block.line}"
        if block.skip is not None:
            continue
        if block.kind == "python":
            try:
                exec(compile(block.code, where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{where}: the python block raised {exc!r}") from exc
        else:
            proc = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", block.code],
                cwd=folder, env=_shell_env(folder), capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, (
                f"{where}: the {block.kind} block exited {proc.returncode}\n{block.code}\n"
                f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
            )
        ran.append(f"{where} {block.kind}")
    return ran


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_docs_page_examples_run(page, fixtures, tmp_path, monkeypatch):
    doc_fixtures.copy_into(fixtures, tmp_path)
    assert run_page(page, tmp_path, monkeypatch)


def test_blocks_are_found_in_order_with_their_no_run_reasons(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n```python\na = 1\n```\n<!-- no-run: needs a GPU -->\n\n```bash\nnvidia-smi\n```\n"
        "```console\n$ enginekit backends \\\n    --json\n[{...}]\n$ echo ok\nok\n```\n"
        "```toml\n[model]\n```\n```\nplain\n```\n"
    )
    found = blocks(page)
    assert [(b.kind, b.skip) for b in found] == [
        ("python", None), ("shell", "needs a GPU"), ("console", None)
    ]  # fmt: skip
    assert found[2].code == "enginekit backends \\\n    --json\necho ok\n"
    assert found[0].line == 2


def test_every_page_under_docs_is_collected():
    names = {str(p.relative_to(ROOT)) for p in pages()}
    assert "README.md" in names and "docs/ci.md" in names
    assert all(n == "README.md" or n.startswith("docs/") for n in names)
