"""docs/verification.md runs as written: its python blocks in one namespace, then its console
commands through the enginekit CLI, in one fresh folder."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "verification.md"


def test_verification_doc_examples_run(tmp_path, monkeypatch):
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    commands = [
        line[2:]
        for block in re.findall(r"```console\n(.*?)```", text, flags=re.S)
        for line in block.splitlines()
        if line.startswith("$ ")
    ]
    assert len(blocks) >= 2 and commands
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {i}", "exec"), namespace)
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "enginekit"
        done = subprocess.run(
            [sys.executable, "-m", "enginekit", *argv[1:]],
            cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "verify_data" in done.stdout and "onnxruntime:" not in done.stderr
