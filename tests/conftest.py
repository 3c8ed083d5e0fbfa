"""Shared fixtures: tiny ONNX models exported once per session, and an ONNX Runtime reference."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from models import CASES, export_case


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def onnx_model(model_dir: Path):
    """``onnx_model(name)`` -> path of the exported case (exported on first use)."""
    pytest.importorskip("torch", reason="the test models are exported from PyTorch")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = export_case(name, model_dir)
        return cache[name]

    return get


def errors_in_threads(call: Callable[[], object], threads: int = 4) -> list[BaseException]:
    """Run ``call`` in ``threads`` threads at once; what each raised (an assert included)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    started = [threading.Thread(target=run) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return errors


def reference(path: Path | Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of ONNX Runtime CPU on the source model (a path or a ModelProto): what every
    backend is held to."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    source = path if isinstance(path, (str, Path)) else path.SerializeToString()
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def matches_reference(
    path: Path, feeds: dict[str, np.ndarray], backend: str, rtol: float, atol: float
) -> None:
    """Builds ``path`` on ``backend`` for exactly the feeds' shapes and checks every output
    against :func:`reference`."""
    import enginekit as ek

    shapes = {k: [v.shape] * 3 for k, v in feeds.items()}
    with ek.build(path, backend=backend, shapes=shapes) as engine:
        got = engine.infer(feeds)
    for name, want in reference(path, feeds).items():
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)


def save_graph(
    tmp_path: Path,
    nodes: list,
    inputs: dict[str, tuple[int, Any]],
    outputs: dict[str, int],
    opset: int,
    init: Any = (),
) -> Path:
    """A one-graph ONNX model of ``nodes`` saved as ``tmp_path/m.onnx``: ``inputs`` maps
    name -> (element type, shape), ``outputs`` name -> element type (shape left to inference)."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
        list(init),
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


@pytest.fixture(scope="session")
def mlp_path(onnx_model) -> Path:
    return onnx_model("mlp")


__all__ = ["CASES", "reference"]


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


#: A folder registering the never-available backend ``absent`` (through an entry point).
PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture
def absent_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """Registers the backend ``absent`` (never available) in this process; returns its name."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    from enginekit import backends

    assert "absent" in backends.names()
    return "absent"
