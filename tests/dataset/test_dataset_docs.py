"""docs/batch-inference.md runs as written: its blocks in order in one fresh folder, Python blocks
sharing one namespace, ``$ `` lines of console blocks through bash; blocks after a
``<!-- no-run: ... -->`` line are skipped (Ray: tests/dataset/test_dataset_ray.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "batch-inference.md"
BLOCK = re.compile(r"(<!-- no-run:[^>]*-->\n)?```(python|console|bash|sh)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    return [(kind, body) for skip, kind, body in BLOCK.findall(DOC.read_text()) if not skip]


@pytest.mark.slow
def test_batch_inference_doc_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    found = blocks()
    assert sum(k == "python" for k, _ in found) >= 5 and any(k == "console" for k, _ in found)
    # `enginekit` on PATH runs this checkout, with the interpreter running the tests.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "enginekit"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m enginekit "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict = {"__name__": "__doc__"}
    for i, (kind, body) in enumerate(found):
        if kind == "python":
            exec(compile(body, f"{DOC.name} block {i}", "exec"), namespace)
            continue
        lines = body.splitlines()
        script = (
            "\n".join(line[2:] for line in lines if line.startswith("$ "))
            if kind == "console"
            else body
        )
        run = subprocess.run(["bash", "-e", "-c", script], env=env, capture_output=True, text=True)
        assert run.returncode == 0, f"block {i}:\n{script}\n{run.stderr}"
    assert (work / "preds-cli" / "part-00000.parquet").is_file()
    assert (work / "preds-parquet-cli" / "_enginekit_ledger.json").is_file()
