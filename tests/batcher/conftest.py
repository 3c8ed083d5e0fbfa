"""The engine most batcher tests wrap: the tiny CNN on ONNX Runtime, built once per module."""

from __future__ import annotations

import pytest
from batcher_engines import build


@pytest.fixture(scope="module")
def cnn(onnx_model):
    engine = build(onnx_model, "cnn")
    yield engine
    engine.close()
