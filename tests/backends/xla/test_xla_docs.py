"""docs/backends/xla.md: its Python example runs as written."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="the XLA backend needs jax")

DOC = Path(__file__).parents[3] / "docs" / "backends" / "xla.md"


def test_doc_example_runs(onnx_model, tmp_path, monkeypatch, capsys):
    shutil.copy(onnx_model("cnn"), tmp_path / "cnn.onnx")
    monkeypatch.chdir(tmp_path)
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)[0]
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    assert sorted(namespace["engine"].programs) == [
        "1x3x16x16", "2x3x16x16", "4x3x16x16", "8x3x16x16"
    ]  # fmt: skip
    assert "nhwc" in capsys.readouterr().out
