"""The model of a build file: an ONNX file as it is, or an exporter entry exported to ONNX."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from enginekit.errors import ExportError


@contextlib.contextmanager
def _path_first(folders: Sequence[Path]) -> Iterator[None]:
    added = [str(p.resolve()) for p in folders]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)


def find_module(module: str, python_path: Sequence[Path]) -> str | None:
    """Why ``module`` cannot be found from ``python_path`` and sys.path, or None if it can.

    Finds without running the module itself (its parent packages are imported).
    """
    with _path_first(python_path):
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as exc:
            found, error = None, f": {exc}"
        else:
            error = ""
    if found is None:
        where = ", ".join(str(p) for p in python_path)
        return (
            f"cannot find module {module!r}{error} (looked in {where} and sys.path); set "
            "model.python_path or give an ONNX file"
        )
    return None


def call_entry(entry: str, python_path: Sequence[Path]) -> tuple[Any, Any]:
    """Import ``pkg.module:function``, call it, and check it returned (model, example_inputs).

    Raises:
        ExportError: the entry cannot be imported or returned something else.
    """
    module_name, _, function = entry.partition(":")
    with _path_first(python_path):
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ExportError(f"model entry {entry!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ExportError(f"model entry {entry!r}: {module_name} has no function {function!r}")
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ExportError(
            f"model entry {entry!r} returned a {type(result).__name__}; expected a tuple "
            "(model, example_inputs)"
        )
    return result
