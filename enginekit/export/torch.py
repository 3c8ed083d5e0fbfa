"""PyTorch -> ONNX through ``torch.onnx.export(dynamo=True)``, checked against eager PyTorch."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.errors import ExportError
from enginekit.quiet import ort_severity, quiet_onnxruntime

NAME = "torch"
log = logging.getLogger(__name__)

#: Models whose parameters exceed this are written with external data (protobuf's 2 GiB cap).
_EXTERNAL_DATA_BYTES = 1 << 30


def accepts(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch when nobody has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # The exporter logs a warning per missing torchvision op and per fallback; keep ours clean.
    loggers = [
        logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _arg_names(model: Any, count: int) -> list[str]:
    params = [
        p for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    if len(params) < count:
        raise ExportError(
            f"forward() takes {len(params)} positional inputs, got {count} example inputs"
        )
    return [p.name for p in params[:count]]


def _flatten(out: Any) -> tuple[list[str] | None, list[Any]]:
    torch = sys.modules["torch"]
    if isinstance(out, torch.Tensor):
        return None, [out]
    if isinstance(out, Mapping):
        return [str(k) for k in out], list(out.values())
    if isinstance(out, (list, tuple)):
        return None, list(out)
    raise ExportError(
        f"forward() returned a {type(out).__name__}; expected tensors (a tensor, tuple, list or dict)"
    )


def _resized(
    args: tuple[Any, ...], axes: Mapping[int, dict[int, str]], size_of: Mapping[str, int]
) -> tuple[Any, ...]:
    """Copies of the example inputs with each dynamic dim resized (rows repeated cyclically)."""
    torch = sys.modules["torch"]
    out = []
    for i, a in enumerate(args):
        for axis, sym in axes.get(i, {}).items():
            index = torch.arange(size_of[sym]) % a.shape[axis]
            a = a.index_select(axis, index)
        out.append(a)
    return tuple(out)


def export(
    model: Any,
    args: Any,
    path: Path,
    *,
    dynamic_batch: bool = True,
    dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
    output_names: list[str] | None = None,
    opset: int | None = None,
    check: bool = True,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> Path:
    """Export ``model`` at ``args`` to ``path`` and check it at two sizes of its dynamic dims.

    Args:
        dynamic_batch: make dim 0 of every input the symbolic ``batch``.
        dynamic_dims: more symbolic dims by ``forward()`` argument name: ``{"ids": {1: "seq"}}``.
        output_names: names of the outputs (default ``output`` or ``output_0``, ``output_1``...;
            the keys when forward() returns a dict).
        opset: ONNX opset (default: the exporter's, >= 18).
        check: run the ONNX model on ONNX Runtime and compare with eager PyTorch.
    """
    import torch

    if not isinstance(args, tuple):
        args = (args,) if not isinstance(args, list) else tuple(args)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise ExportError("example inputs must be tensors (a tensor or a tuple of tensors)")
    if opset is not None and opset < 18:
        raise ExportError(f"opset {opset}: the dynamo exporter emits opset 18 or newer")
    model = model.eval()
    names = _arg_names(model, len(args))
    unknown = set(dynamic_dims or {}) - set(names)
    if unknown:
        raise ExportError(
            f"dynamic_dims name {sorted(unknown)}, which are not forward() inputs ({', '.join(names)})"
        )

    axes: dict[int, dict[int, str]] = {}
    for i, (n, a) in enumerate(zip(names, args)):
        dims = dict((dynamic_dims or {}).get(n, {}))
        if dynamic_batch and a.ndim > 0:
            dims.setdefault(0, "batch")
        for axis in dims:
            if not -a.ndim <= axis < a.ndim:
                raise ExportError(
                    f"dynamic_dims[{n!r}] names axis {axis}; the input has rank {a.ndim}"
                )
        axes[i] = {axis % a.ndim: sym for axis, sym in dims.items()}
    # torch.export specializes dims of size 0 or 1: export at size >= 2, check at two sizes.
    example_size: dict[str, int] = {}
    for i, a in enumerate(args):
        for axis, sym in axes[i].items():
            example_size.setdefault(sym, int(a.shape[axis]))
    export_size = {s: max(2, n) for s, n in example_size.items()}
    export_args = _resized(args, axes, export_size)
    syms = {s: torch.export.Dim(s) for s in export_size}
    dynamic_shapes = {
        n: {axis: syms[sym] for axis, sym in axes[i].items()} for i, n in enumerate(names)
    }

    with torch.no_grad():
        keys, outs = _flatten(model(*export_args))
    if output_names is None:
        output_names = keys or (
            ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]
        )
    elif len(output_names) != len(outs):
        raise ExportError(
            f"output_names has {len(output_names)} names; forward() returns {len(outs)} outputs"
        )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    large = sum(p.numel() * p.element_size() for p in model.parameters()) > _EXTERNAL_DATA_BYTES
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp = tmpdir / path.name
        try:
            with _quiet(), torch.no_grad():
                torch.onnx.export(
                    model, export_args, str(tmp), dynamo=True,
                    dynamic_shapes=dynamic_shapes if syms else None,
                    input_names=names, output_names=output_names,
                    opset_version=opset, external_data=large, verbose=False,
                )  # fmt: skip
        except Exception as exc:
            raise ExportError(f"torch.onnx.export failed: {_summary(exc)}") from exc
        if check:
            sizes = [example_size, {s: n + 2 for s, n in export_size.items()}]
            for size in sizes if syms else sizes[:1]:
                _check(model, tmp, names, _resized(args, axes, size) if syms else args, atol, rtol)
        for f in tmpdir.iterdir():
            os.replace(f, path.parent / f.name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    log.info("exported %s (%d inputs, %d outputs)", path, len(names), len(output_names))
    return path


def _summary(exc: BaseException) -> str:
    text = str(exc)
    marker = "## Exception summary"
    if marker in text:
        text = text.split(marker, 1)[1].split("(Refer to", 1)[0]
    return " ".join(text.split())[:800]


def _check(
    model: Any, onnx_path: Path, names: list[str], args: tuple[Any, ...], atol: float, rtol: float
) -> None:
    import onnxruntime as ort
    import torch

    with torch.no_grad():
        _, expected = _flatten(model(*args))
    so = ort.SessionOptions()
    quiet_onnxruntime()
    so.log_severity_level = ort_severity()
    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    feeds = {n: a.detach().cpu().numpy() for n, a in zip(names, args)}
    got = session.run(None, feeds)
    worst = (0.0, "")
    for out, (e, g) in zip(session.get_outputs(), zip(expected, got)):
        e = e.detach().cpu().numpy()
        if e.shape != g.shape:
            raise ExportError(
                f"the ONNX model's output {out.name!r} has shape {g.shape}, PyTorch gives {e.shape} "
                f"(inputs {[tuple(a.shape) for a in args]}): a dynamic dim was baked in"
            )
        diff = np.abs(e.astype(np.float64) - g.astype(np.float64))
        bad = diff > atol + rtol * np.abs(e)
        if diff.size and float(diff.max()) > worst[0]:
            worst = (float(diff.max()), out.name)
        if np.any(bad):
            raise ExportError(
                f"the ONNX model does not match PyTorch: output {out.name!r} differs by up to "
                f"{float(diff.max()):.3g} (atol={atol}, rtol={rtol}) at inputs "
                f"{[tuple(a.shape) for a in args]}"
            )
    log.info(
        "export check at %s: largest difference %.3g (%s)", [tuple(a.shape) for a in args], *worst
    )
