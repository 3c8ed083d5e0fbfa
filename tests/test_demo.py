"""`make demo` runs examples/demo.py: the README's first command, run here as a user would (a
fresh working directory, the script's own output), so a change that breaks it fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo exports a PyTorch model (enginekit[torch])")

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_make_demo_script_exports_builds_verifies_and_infers(tmp_path):
    run = subprocess.run(
        [sys.executable, str(DEMO), "--seconds", "0.05"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert set(lines) == {"exported", "built", "verified", "inference", "throughput"}
    assert "top-1 agreement 100%" in lines["inference"]
    assert (tmp_path / "demo-out" / "cnn.ekit").is_file()
