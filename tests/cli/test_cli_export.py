"""``enginekit export`` of PyTorch entries: ``(model, example_inputs)`` entries (the form
enginekit.toml uses), ``-i`` by forward() argument name, and a missing ``-i`` pointing to it."""

from __future__ import annotations

import numpy as np
import pytest
from test_cli import cli

pytest.importorskip("torch")

ENTRY = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def make_classifier():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 16),)


net = Net().eval()
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "my_models.py").write_text(ENTRY)
    np.save(tmp_path / "example.npy", np.ones((2, 16), np.float32))
    return tmp_path


@pytest.mark.slow
def test_an_entry_returning_model_and_example_inputs_exports(project):
    r = cli("export", "my_models:make_classifier", "-o", "c.onnx", cwd=project)
    assert r.returncode == 0, r.stderr
    assert "x: float32[batchx16]" in r.stdout and (project / "c.onnx").is_file()


@pytest.mark.slow
def test_inputs_are_matched_to_forward_arguments_by_name(project):
    ok = cli("export", "my_models.py:net", "-o", "n.onnx", "-i", "x=example.npy", cwd=project)
    assert ok.returncode == 0, ok.stderr
    wrong = cli(
        "export", "my_models.py:net", "-o", "n.onnx", "-i", "input=example.npy", cwd=project
    )
    assert wrong.returncode == 2 and "-i input" in wrong.stderr and "(it takes: x)" in wrong.stderr


def test_a_pytorch_model_without_inputs_points_to_dash_i(project):
    r = cli("export", "my_models.py:net", "-o", "n.onnx", cwd=project)
    assert r.returncode == 2 and "-i NAME=FILE.npy" in r.stderr and "(x)" in r.stderr
