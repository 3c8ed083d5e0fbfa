"""References that engines are held to: ONNX Runtime CPU FP32 on the source model (the default),
another backend built at fp32, or the source framework model (a torch module or any callable).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from enginekit.config import ShapeProfile
from enginekit.engine import to_numpy
from enginekit.errors import UsageError
from enginekit.model import Model, reference_session

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]

#: Names that mean the default reference.
DEFAULT_NAMES = ("onnxruntime", "onnxruntime-cpu", "ort")


@dataclasses.dataclass(frozen=True)
class Reference:
    """A way to compute reference outputs: ``run(feeds) -> outputs``; ``close()`` when done."""

    label: str
    run: Callable[[Feeds], Feeds]
    close: Callable[[], None] = lambda: None


def _as_array(value: Any, name: str) -> np.ndarray:
    detach = getattr(value, "detach", None)
    if callable(detach):  # a torch tensor, possibly on a device or requiring grad
        return np.asarray(detach().cpu().numpy())
    return to_numpy(value, name)


def outputs_by_name(result: Any, names: Sequence[str], label: str) -> Feeds:
    """A reference's result (mapping, sequence in output order, or one array) as name -> array."""
    if isinstance(result, Mapping):
        return {str(k): _as_array(v, str(k)) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        if len(result) != len(names):
            raise UsageError(
                f"reference {label}: returned {len(result)} outputs, the model has "
                f"{len(names)} ({', '.join(names)})"
            )
        return {n: _as_array(v, n) for n, v in zip(names, result)}
    if len(names) != 1:
        raise UsageError(
            f"reference {label}: returned one array, the model has {len(names)} outputs "
            f"({', '.join(names)}); return a sequence in output order or a dict"
        )
    return {names[0]: _as_array(result, names[0])}


def _torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch module cannot exist unless torch was imported
    return torch is not None and isinstance(obj, torch.nn.Module)


def _torch_reference(module: Any, inputs: Sequence[str], outputs: Sequence[str]) -> Reference:
    import torch

    if module.training:
        log.warning("the reference torch module is in training mode; call .eval() on it first")
    label = f"torch {type(module).__name__}"

    def run(feeds: Feeds) -> Feeds:
        with torch.no_grad():
            result = module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in inputs))
        return outputs_by_name(result, outputs, label)

    return Reference(label, run)


def _callable_reference(
    fn: Callable[..., Any], inputs: Sequence[str], outputs: Sequence[str]
) -> Reference:
    label = f"callable {getattr(fn, '__qualname__', type(fn).__name__)}"

    def run(feeds: Feeds) -> Feeds:
        return outputs_by_name(fn(*(feeds[n] for n in inputs)), outputs, label)

    return Reference(label, run)


def _ort_reference(model: Model) -> Reference:
    session = reference_session(model)
    names = [o.name for o in model.outputs]

    def run(feeds: Feeds) -> Feeds:
        return dict(zip(names, session.run(names, feeds)))

    return Reference("onnxruntime-cpu fp32", run)


def _backend_reference(
    name: str, model: Model, profiles: Sequence[Mapping[str, ShapeProfile]], device: str
) -> Reference:
    from enginekit.build import build

    engine = build(model, backend=name, shapes=list(profiles) or None, device=device, verify=False)
    return Reference(f"{name} fp32", engine.infer, engine.close)


def resolve_reference(
    reference: str | Callable[..., Any] | None,
    model: Model | None,
    device: str = "cpu",
    profiles: Sequence[Mapping[str, ShapeProfile]] = (),
) -> Reference:
    """The Reference meant by ``reference`` (see :func:`enginekit.evaluate.compare`).

    Raises:
        UsageError: no model to run the default or a backend reference on; not a reference.
    """
    if reference is not None and not isinstance(reference, str):
        if model is None:
            raise UsageError("a framework reference needs the ONNX model for its input names")
        inputs = [s.name for s in model.inputs]
        outputs = [s.name for s in model.outputs]
        if _torch_module(reference):
            return _torch_reference(reference, inputs, outputs)
        if callable(reference):
            return _callable_reference(reference, inputs, outputs)
        raise UsageError(
            f"reference {reference!r}: expected 'onnxruntime', a backend name, a torch module "
            "or a callable"
        )
    if model is None:
        raise UsageError(
            "no reference: give the ONNX model (the reference runs it) or a golden .npz"
        )
    if reference is None or reference in DEFAULT_NAMES:
        return _ort_reference(model)
    return _backend_reference(reference, model, profiles, device)
