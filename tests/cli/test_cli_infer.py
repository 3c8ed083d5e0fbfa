"""``enginekit infer``: a dataset through an artifact into shards, the summary, exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="enginekit infer reads and writes Arrow/Parquet")

from models import CASES

from enginekit.cli import main


@pytest.fixture(scope="module")
def artifact(onnx_model, tmp_path_factory):
    import enginekit as ek

    path = tmp_path_factory.mktemp("cli-infer") / "cnn.ekit"
    ek.build(onnx_model("cnn"), shapes=CASES["cnn"].shapes, output=path).close()
    return path


def test_infer_images_with_preprocessing_then_resume_prints_json(artifact, tmp_path, capsys):
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(
            tmp_path / "imgs" / f"{i}.png"
        )
    args = [
        "infer", str(artifact), str(tmp_path / "imgs"), "-o", str(tmp_path / "out"),
        "--resize", "18", "--crop", "16x16", "--mean", "0.5,0.5,0.5", "--std", "0.25",
        "--batch-size", "2", "--shard-rows", "2", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "5 rows in 3 shard(s)" in text
    assert "stages: read" in text and "bottleneck: " in text
    assert pq.read_table(tmp_path / "out").column("path").to_pylist() == [
        f"{i}.png" for i in range(5)
    ]
    assert main([*args, "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["rows_skipped"], summary["shards_written"], summary["resumed"]) == (5, 0, True)
    assert summary["stages"]["batches"] == 0 and summary["bottleneck"] in ("read", "infer", "write")


def test_infer_refuses_existing_output_and_bad_columns_with_exit_codes(artifact, tmp_path, capsys):
    np.savez(tmp_path / "d.npz", pixels=np.zeros((4, 3, 16, 16), np.float32))
    out = str(tmp_path / "out")
    assert (
        main(["infer", str(artifact), str(tmp_path / "d.npz"), "-o", out, "--column", "x=pixel"])
        == 1
    )
    assert "closest: 'pixels'" in capsys.readouterr().err
    assert (
        main(
            [
                "infer",
                str(artifact),
                str(tmp_path / "d.npz"),
                "-o",
                out,
                "--column",
                "x=pixels",
                "--format",
                "npz",
            ]
        )
        == 0
    )
    assert (
        main(["infer", str(artifact), str(tmp_path / "d.npz"), "-o", out, "--column", "x=pixels"])
        == 1
    )
    assert "--resume" in capsys.readouterr().err
    assert (
        main(["infer", str(artifact), str(tmp_path / "d.npz"), "-o", out, "--batch-size", "x"]) == 2
    )
    assert (
        main(["infer", str(artifact), str(tmp_path / "d.npz"), "-o", out, "--max-memory", "lots"])
        == 2
    )


def test_infer_streams_and_threads_flags_reach_the_summary(artifact, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((6, 3, 16, 16), np.float32))
    args = ["infer", str(artifact), str(tmp_path / "x.npy"), "-o", str(tmp_path / "out"),
            "--batch-size", "2", "--streams", "2", "--threads", "1", "--no-progress"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["streams"], summary["threads"], summary["rows"]) == (2, 1, 6)
    assert main([*args[:-7], "--streams", "many"]) != 0
    assert "--streams 'many'" in capsys.readouterr().err
