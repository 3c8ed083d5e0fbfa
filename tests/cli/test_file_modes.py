"""Everything enginekit writes honours the umask like a plain open() (issue 19, item 1): a Triton
server or a CI job running as another user reads the artifacts, reports and cache entries."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from enginekit.cli import main


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _bad_modes(root: Path) -> list[str]:
    """Files not 0644 and folders not 0755 under root (the modes of umask 022)."""
    bad = []
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o755 if p.is_dir() else 0o644
        if mode != want:
            bad.append(f"{p.relative_to(root.parent)}: {oct(mode)}")
    return bad


def test_every_written_file_and_folder_is_readable_by_others(mlp_path, tmp_path, umask022):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(mlp_path, out / "mlp.onnx")
    shapes = ["--shapes", "x:1x16,4x16,8x16"]
    assert main(["build", str(out / "mlp.onnx"), *shapes, "-o", str(out / "m.ekit")]) == 0
    assert main(["build", str(out / "mlp.onnx"), *shapes, "-o", str(out / "mdir") + "/"]) == 0
    np.save(out / "x.npy", np.ones((2, 16), np.float32))
    assert (
        main(["run", str(out / "m.ekit"), "-i", f"x={out / 'x.npy'}", "-o", str(out / "y.npz")])
        == 0
    )
    assert main(["prepare", str(out / "mlp.onnx"), "-o", str(out / "prepared.onnx")]) == 0
    golden = ["--save-golden", str(out / "golden.npz")]
    assert main(["compare", str(out / "mlp.onnx"), "--backends", "onnxruntime", *golden]) == 0
    assert main(["export-triton", str(out / "m.ekit"), "--repo", str(out / "triton")]) == 0
    (out / "enginekit.toml").write_text(
        '[model]\nsource = "mlp.onnx"\n[shapes]\nx = ["1x16", "4x16", "8x16"]\n'
        '[[engine]]\nbackend = "onnxruntime"\n[bench]\nenabled = false\n'
    )
    cfg = ["-c", str(out / "enginekit.toml"), "--out", str(out / "dist")]
    assert main(["build", *cfg, "--cache", str(out / "cache")]) == 0
    assert _bad_modes(out) == []
