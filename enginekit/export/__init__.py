"""Framework -> ONNX exporters, chosen by the kind of model given.

An exporter is a module with ``NAME``, ``accepts(obj) -> bool`` (must not import its framework:
a model of a framework that was never imported cannot exist) and
``export(obj, args, path, **options) -> Path``. Built-ins are listed in ``_BUILTIN``; third
parties add more through the ``enginekit.exporters`` entry-point group.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any

from enginekit.errors import ExportError

_BUILTIN: dict[str, str] = {
    "torch": "enginekit.export.torch",
    "tensorflow": "enginekit.export.tensorflow",
}


def exporters() -> dict[str, Any]:
    """Every registered exporter module by name (imports them; they import no framework)."""
    found = {name: importlib.import_module(mod) for name, mod in _BUILTIN.items()}
    for ep in importlib.metadata.entry_points(group="enginekit.exporters"):
        if ep.name not in found:
            obj = ep.load()
            found[ep.name] = importlib.import_module(obj) if isinstance(obj, str) else obj
    return found


def export(
    model: Any, args: Any = None, path: str | os.PathLike = "model.onnx", **options: Any
) -> Path:
    """Export a framework model to an ONNX file, checked against the framework's own outputs.

    Args:
        model: a ``torch.nn.Module`` (or any model a registered exporter accepts).
        args: example inputs (a tensor or a tuple of tensors, in ``forward()`` order).
        path: the ONNX file to write; written whole or not at all.
        **options: exporter options, e.g. ``dynamic_batch=True``,
            ``dynamic_dims={"input_ids": {1: "seq"}}``, ``output_names=[...]``, ``opset=20``.

    Returns:
        the path written.

    Raises:
        ExportError: no exporter accepts the model, the export fails, or it does not match.
    """
    for mod in exporters().values():
        if mod.accepts(model):
            return mod.export(model, args, Path(path), **options)
    if isinstance(model, (str, os.PathLike)):
        takes = [f"{n}: {m.PATHS}" for n, m in exporters().items() if getattr(m, "PATHS", None)]
        raise ExportError(
            f"no exporter accepts the path {model}; paths they take: {'; '.join(takes)}. "
            "An .onnx file needs no export: pass it to build()"
        )
    raise ExportError(
        f"no exporter accepts a {type(model).__module__}.{type(model).__qualname__}; "
        f"registered exporters: {', '.join(exporters())}. Export it to ONNX yourself and "
        "pass the .onnx path to build()."
    )
