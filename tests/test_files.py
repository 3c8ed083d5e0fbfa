"""files.py: a file appears whole or not at all, and an old one survives a failed write."""

from __future__ import annotations

import os
import stat

import pytest

from enginekit.files import atomic_dir, atomic_path, atomic_write, copy_atomic, dir_mode, file_mode


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


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_honour_the_umask_like_a_plain_open(tmp_path, umask):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    with atomic_write(tmp_path / "atomic.txt", "w") as f:
        f.write("x")
    with atomic_path(tmp_path / "path.bin") as tmp:
        tmp.write_bytes(b"x")
    assert _mode(tmp_path / "atomic.txt") == _mode(plain) == 0o666 & ~umask
    assert _mode(tmp_path / "path.bin") == 0o666 & ~umask
    copy_atomic(plain, tmp_path / "copy.txt")
    assert _mode(tmp_path / "copy.txt") == 0o666 & ~umask


def test_atomic_dir_gets_the_mode_of_a_plain_mkdir_and_replaces_the_old_one(tmp_path, umask):
    (tmp_path / "plain").mkdir()
    for text in ("one", "two"):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "f.txt").write_text(text)
    assert _mode(tmp_path / "out") == _mode(tmp_path / "plain") == 0o777 & ~umask
    assert (tmp_path / "out" / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "plain"]


def test_file_and_dir_modes_follow_the_umask(umask):
    assert file_mode() == 0o666 & ~umask and dir_mode() == 0o777 & ~umask
