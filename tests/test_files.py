"""files.py: a file appears whole or not at all, and an old one survives a failed write."""

from __future__ import annotations

import pytest

from enginekit.files import atomic_path, atomic_write


def test_atomic_write_replaces_the_file_and_creates_its_folder(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    with atomic_write(target, "w") as f:
        f.write("one")
    with atomic_write(target, "w") as f:
        f.write("two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_write(target) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_atomic_path_gives_a_path_beside_the_target(tmp_path):
    target = tmp_path / "model.onnx"
    with atomic_path(target, suffix=".onnx") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.onnx.tmp-")
        assert tmp.suffix == ".onnx"
        tmp.write_bytes(b"x")
    assert target.read_bytes() == b"x" and not tmp.exists()
