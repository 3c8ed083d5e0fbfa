"""The engines the batcher tests share: built once per session (each build takes seconds on
2 cores; every test wraps them or only calls ``infer``, which is thread-safe)."""

from __future__ import annotations

import pytest

from .batcher_engines import build


@pytest.fixture(scope="session")
def cnn(onnx_model):
    engine = build(onnx_model, "cnn")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def encoder(onnx_model):
    engine = build(onnx_model, "transformer")
    yield engine
    engine.close()
