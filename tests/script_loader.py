"""Scripts that are not package modules (``benchmarks/*.py``, ``tests/gpu/*.py``), loaded as
modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` executed as the module ``name``, registered in ``sys.modules`` first: a
    script's dataclasses look their module up there. Load a benchmark script under another
    name than its stem: registered under it, ``find_spec(stem)`` finds the script, and the
    check that no benchmark script shadows an installed package fails on it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
