"""docs/batcher.md runs as written: its Python blocks in order, in one namespace, in a fresh
folder — the model, the calls, and the ASGI app called directly with 32 concurrent requests."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent.parent / "docs" / "batcher.md"


def test_batcher_page_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    before = set(threading.enumerate())
    namespace: dict = {"__name__": "__doc__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {i}", "exec"), namespace)
    assert namespace["batcher"].closed
    assert namespace["batcher"].stats()["completed"] == 32
    assert set(threading.enumerate()) <= before | {
        t for t in threading.enumerate() if not t.name.startswith("batcher-")
    }
    namespace["engine"].close()
