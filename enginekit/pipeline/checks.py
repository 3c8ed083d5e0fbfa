"""Checks of the build file against the model and the backends registered here (no building)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginekit.config import ShapeProfile
from enginekit.errors import EnginekitError, UnknownBackend, did_you_mean

if TYPE_CHECKING:
    from enginekit.pipeline.locate import Collector
    from enginekit.pipeline.locate import Path as KeyPath


@functools.lru_cache(maxsize=8)
def _graph(path: Path) -> Any:
    import onnx

    # Weights are not needed to check names and shapes: leave external data unread.
    return onnx.load_model(str(path), load_external_data=False)


def model_has_qdq(path: Path) -> bool:
    """Whether the ONNX model already carries QuantizeLinear/DequantizeLinear nodes."""
    try:
        graph = _graph(path).graph
    except Exception:
        return False
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)


def check_shapes(
    model_path: Path, profiles: tuple[dict[str, ShapeProfile], ...], c: Collector
) -> None:
    """Profiles name real inputs with their rank and fixed dims; dynamic dims past the batch
    have shapes (verification cannot make up a sequence length)."""
    from enginekit.model import Model, check_profiles, io_specs

    try:
        proto = _graph(model_path)
    except Exception as exc:
        c.error(("model", "source"), f"{model_path}: not a readable ONNX model ({exc})")
        return
    inputs, outputs = io_specs(proto)
    model = Model(proto, model_path, "", inputs, outputs)
    names = [s.name for s in inputs]
    array_form = ("shapes", 0) in c.lines
    for i, profile in enumerate(profiles):
        for name, prof in profile.items():
            key: KeyPath = ("shapes", i, name) if array_form else ("shapes", name)
            if name not in names:
                hint = did_you_mean(name, names)
                c.error(key, f"the model has no input {name!r}{hint} (inputs: {', '.join(names)})")
                continue
            try:
                check_profiles(model, ({name: prof},))
            except EnginekitError as exc:
                c.error(key, str(exc))
    covered = set(profiles[0]) if profiles else set()
    for spec in inputs:
        if spec.name in covered:
            continue
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str) and axis > 0:
                c.error(
                    ("shapes",),
                    f"input {spec.name!r} dim {axis} is dynamic ({dim!r}); give its shapes, "
                    f'e.g. {spec.name} = ["min", "opt", "max"] as AxB strings',
                )
                break


def check_outputs(model_path: Path, outputs: Sequence[str], c: Collector) -> None:
    """Every tensor named in ``model.outputs`` is computed somewhere in the graph."""
    try:
        graph = _graph(model_path).graph
    except Exception:
        return  # check_shapes reports an unreadable model
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for i, name in enumerate(outputs):
        if name not in known:
            hint = did_you_mean(name, sorted(known))
            c.error(("model", "outputs", i), f"the model computes no tensor {name!r}{hint}")


def check_backend(
    backend: str,
    precisions: Sequence[str],
    has_layout: bool,
    options: dict[str, Any],
    key: KeyPath,
    c: Collector,
) -> None:
    """Options, layout and precisions the backend knows, where it is registered here; an
    unregistered backend is a warning (its entries are skipped on this runner)."""
    from enginekit import backends

    try:
        module = backends.get(backend)
    except UnknownBackend as exc:
        c.error((*key, "backend"), str(exc))
        return
    except Exception as exc:  # a broken plugin must not hide the other problems
        c.warn((*key, "backend"), f"backend {backend!r} fails to import: {exc}")
        return
    known = dict(getattr(module, "OPTIONS", {}))
    listing = ", ".join(sorted(known)) or "none"
    for name in options:
        if name not in known:
            hint = did_you_mean(name, known)
            c.error(
                (*key, "options", name),
                f"backend {backend!r} has no option {name!r}{hint} (its options: {listing})",
            )
    if has_layout and "layout" not in known:
        c.error(
            (*key, "layout"),
            f"backend {backend!r} has no 'layout' option (its options: {listing})",
        )
    listed = getattr(module, "PRECISIONS", None)
    if listed is not None:
        for precision in precisions:
            if precision not in listed:
                c.error(
                    (*key, "precision"),
                    f"backend {backend!r} builds {', '.join(listed)}, not {precision}",
                )
