"""The Python examples in docs/compare-bench.md run as written (on a tiny model.onnx)."""

from __future__ import annotations

import re
import shutil

import pytest
from compare_helpers import ROOT, tiny_mlp

DOC = ROOT / "docs" / "compare-bench.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_doc_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index, tmp_path, monkeypatch):
    model = tiny_mlp(tmp_path / "model.onnx")
    assert model.exists()
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"{DOC.name} block {index}", "exec"), {"__name__": "__doc__"})
    shutil.rmtree(tmp_path, ignore_errors=True)
