"""The Python examples in README.md run as written (with the models they name defined here)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def readme_namespace() -> dict:
    torch = pytest.importorskip("torch")
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(30, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return (self.embed(input_ids) * attention_mask[..., None]).sum(1)

    return {
        "torch_model": Net().eval(),
        "example_x": torch.randn(1, 16),
        "encoder": Encoder().eval(),
        "ids": torch.randint(0, 30, (2, 5)),
        "mask": torch.ones(2, 5),
        "x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32),
    }


def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "README.md has no python example"
    monkeypatch.chdir(tmp_path)
    namespace = readme_namespace()
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    engine = namespace["engine"]
    assert engine.infer(namespace["x"])["output"].shape == (4, 4)
    assert (tmp_path / "model.ekit").is_file() and (tmp_path / "enc.onnx").is_file()
