"""Engines for the dataset tests (real ONNX Runtime engines built from the tiny test models) and
small datasets written in each format."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="the dataset jobs read and write Arrow/Parquet")

from models import CASES


@pytest.fixture(scope="session")
def ekit(onnx_model, tmp_path_factory):
    """``ekit(name)`` -> path of an ONNX Runtime artifact of that test model (built once)."""
    import enginekit as ek

    built: dict[str, Path] = {}
    folder = tmp_path_factory.mktemp("ekits")

    def get(name: str) -> Path:
        if name not in built:
            path = folder / f"{name}.ekit"
            ek.build(onnx_model(name), shapes=CASES[name].shapes, output=path).close()
            built[name] = path
        return built[name]

    return get
