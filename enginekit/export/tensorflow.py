"""TensorFlow / Keras -> ONNX through tf2onnx, checked against TensorFlow itself.

Accepts a ``tf.function`` (with an ``input_signature``, or example inputs), a Keras 3 model, a
loaded SavedModel, a SavedModel directory or a ``.keras`` file. Everything is traced through a
``tf.function`` of enginekit's own with one flat, named signature and converted with tf2onnx's
``from_function`` (its ``from_keras`` fails on Keras 3 with ``KeyError: 'keras_tensor_N'``).
Keras models are always called with ``training=False``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from enginekit.errors import ExportError
from enginekit.export._tf2onnx import Target
from enginekit.files import atomic_path
from enginekit.quiet import held_output

NAME = "tensorflow"
#: What paths this exporter takes (the registry quotes it when nothing accepts a path).
PATHS = "a SavedModel directory (holding saved_model.pb) or a .keras file"
#: tf2onnx 1.17 converts to ai.onnx opsets up to 18; 18 is also what the PyTorch exporter emits.
MAX_OPSET = 18
MIN_OPSET = 9
log = logging.getLogger(__name__)


def _path_kind(path: Path) -> str | None:
    if path.suffix == ".keras":
        return "keras"
    if path.is_dir() and any((path / n).is_file() for n in ("saved_model.pb", "saved_model.pbtxt")):
        return "savedmodel"
    return None


def accepts(obj: Any) -> bool:
    """True for a SavedModel directory or ``.keras`` path, or (only when TensorFlow or Keras is
    already imported) a tf.function, a ConcreteFunction, a Keras model or a loaded SavedModel."""
    if isinstance(obj, (str, os.PathLike)):
        return _path_kind(Path(obj)) is not None
    tf = sys.modules.get("tensorflow")
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(obj, keras.Model):
        return True
    if tf is None:
        return False
    kinds = (tf.types.experimental.GenericFunction, tf.types.experimental.ConcreteFunction)
    return isinstance(obj, kinds) or (isinstance(obj, tf.Module) and _has_signatures(obj))


def _has_signatures(obj: Any) -> bool:
    try:
        return len(obj.signatures) > 0
    except (AttributeError, TypeError):
        return False


def _tf() -> Any:
    """Import TensorFlow, quiet unless the user chose its C++ log level."""
    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
        import tf2onnx  # noqa: F401
    except ImportError as exc:
        raise ExportError(
            f"TensorFlow export needs tensorflow and tf2onnx ({exc}); "
            "pip install 'enginekit[tf]' (tensorflow-cpu and tf2onnx)"
        ) from None
    return tf


# -- what is being exported --------------------------------------------------------------------


def _clean(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name.split(":")[0]) or "input"
    if not re.match(r"[A-Za-z0-9.]", base):
        base = "x" + base
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


def _dims(shape: Any) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in shape)


def _from_specs(
    tf: Any, specs: Sequence[Any], hints: Sequence[str | None]
) -> tuple[tuple[str, ...], tuple[Any, ...], tuple[tuple[int | None, ...], ...]]:
    taken: set[str] = set()
    names = tuple(_clean(h or f"input_{i}", taken) for i, h in enumerate(hints))
    dtypes = tuple(tf.as_dtype(s.dtype) for s in specs)
    shapes = tuple(_dims(s.shape) for s in specs)
    return names, dtypes, shapes


def _example_target(
    tf: Any,
    args: Any,
    call: Callable[..., Any],
    hints: list[str],
    what: str,
    floatx: str | None = None,
) -> Target:
    """A target whose signature comes from example inputs (dims as given, all fixed); float
    examples take the dtype ``floatx`` when given (Keras computes in its floatx)."""
    arrays = _as_arrays(args, hints)
    specs = [
        tf.TensorSpec(a.shape, tf.as_dtype(floatx if floatx and a.dtype.kind == "f" else a.dtype))
        for a in arrays.values()
    ]
    names, dtypes, shapes = _from_specs(tf, specs, list(arrays))
    return Target(call, names, dtypes, shapes, True, None, what)


def _leaf_keys(structure: Any, key: str = "input") -> list[str]:
    """The innermost dict key (or the position) of each leaf, in tf.nest.flatten's order."""
    if isinstance(structure, Mapping):
        return [k for name in sorted(structure) for k in _leaf_keys(structure[name], str(name))]
    if isinstance(structure, (list, tuple)):
        return [k for i, v in enumerate(structure) for k in _leaf_keys(v, f"{key}_{i}")]
    return [key]


def _function_target(tf: Any, fn: Any, args: Any) -> Target:
    py = fn.python_function
    params = [
        p.name
        for p in inspect.signature(py).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if fn.input_signature is None:
        if args is None:
            raise ExportError(
                "the tf.function has no input_signature, so its inputs are unknown: decorate it "
                "with @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, "
                "name='x')]) or pass example inputs as args"
            )
        return _example_target(tf, args, py, params, "tf.function")
    structure = fn.input_signature
    specs = tf.nest.flatten(structure)
    top = len(structure) == len(specs)  # flat: one TensorSpec per argument
    paths = _leaf_keys(structure)
    hints = [
        s.name or (params[i] if top and i < len(params) else paths[i]) for i, s in enumerate(specs)
    ]
    names, dtypes, shapes = _from_specs(tf, specs, hints)

    def call(*xs: Any) -> Any:
        return py(*tf.nest.pack_sequence_as(structure, list(xs)))

    return Target(call, names, dtypes, shapes, True, None, "tf.function")


def _concrete_target(tf: Any, cf: Any, what: str, keep: Any = None) -> Target:
    pos, kw = cf.structured_input_signature
    pos_specs = tf.nest.flatten(pos)
    kw_keys = list(kw)
    kw_specs = [kw[k] for k in kw_keys]
    if any(tf.nest.flatten(kw[k]) != [kw[k]] for k in kw_keys):
        raise ExportError(f"{what}: nested keyword inputs are not supported; flatten them")
    hints = [s.name for s in pos_specs] + kw_keys
    names, dtypes, shapes = _from_specs(tf, pos_specs + kw_specs, hints)
    n = len(pos_specs)

    def call(*xs: Any) -> Any:
        _ = keep  # a loaded SavedModel must outlive the functions that read its variables
        return cf(*tf.nest.pack_sequence_as(pos, list(xs[:n])), **dict(zip(kw_keys, xs[n:])))

    outputs = cf.structured_outputs
    out_names = tuple(outputs) if isinstance(outputs, Mapping) else None
    return Target(call, names, dtypes, shapes, False, out_names, what)


def _keras_target(tf: Any, model: Any, args: Any) -> Target:
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ExportError(
            f"the Keras backend is {keras.backend.backend()!r}; TensorFlow export traces the "
            "model with TensorFlow: set KERAS_BACKEND=tensorflow before importing keras"
        )
    structure = _keras_inputs(model)
    what = f"Keras model {model.name!r}"
    names = getattr(model, "output_names", None)
    out_names = tuple(names) if isinstance(names, (list, tuple)) and names else None
    if structure is None:
        if args is None:
            raise ExportError(
                f"{what} has no defined inputs (subclassed or never built): pass example "
                "inputs as args, or build it from keras.Input(...)"
            )
        t = _example_target(
            tf,
            args,
            lambda *xs: model(xs[0] if len(xs) == 1 else list(xs), training=False),
            [],
            what,
            floatx=keras.config.floatx(),
        )
        return dataclasses.replace(t, output_names=out_names)
    flat = tf.nest.flatten(structure)
    specs = [tf.TensorSpec(k.shape, k.dtype) for k in flat]
    in_names, dtypes, shapes = _from_specs(tf, specs, [getattr(k, "name", None) for k in flat])

    def call(*xs: Any) -> Any:
        # training=False: Dropout is the identity and BatchNorm uses its moving statistics.
        return model(tf.nest.pack_sequence_as(structure, list(xs)), training=False)

    return Target(call, in_names, dtypes, shapes, True, out_names, what)


def _keras_inputs(model: Any) -> Any:
    """The model's input structure of KerasTensors; None when it has none (subclassed, unbuilt)."""
    try:
        return model.input  # a functional model's structure: one tensor, a list or a dict
    except (AttributeError, ValueError):
        pass
    try:
        inputs = list(model.inputs)  # a Sequential model built from keras.Input
    except (AttributeError, TypeError, ValueError):
        return None
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else inputs


def _savedmodel_target(tf: Any, loaded: Any, signature: str, where: str) -> Target:
    sigs = dict(loaded.signatures) if _has_signatures(loaded) else {}
    if signature not in sigs:
        if not sigs:
            raise ExportError(
                f"{where} has no serving signatures; save it with tf.saved_model.save(obj, "
                "path, signatures=obj.__call__.get_concrete_function(...)), or export its "
                "tf.function directly"
            )
        raise ExportError(
            f"{where} has no signature {signature!r}; it has: {', '.join(sigs)}. Pick one "
            "with signature=..."
        )
    return _concrete_target(tf, sigs[signature], f"{where} signature {signature!r}", loaded)


def _check_path(path: Path) -> str:
    """The kind of model file at ``path``; refused before TensorFlow is imported (seconds)."""
    kind = _path_kind(path)
    if kind == "keras" and not path.is_file():
        raise ExportError(f"{path}: no such .keras file")
    if kind is None:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) if path.is_dir() else ""
        what = f"a directory holding {found or 'nothing'}" if path.is_dir() else "not a directory"
        raise ExportError(
            f"{path}: not a SavedModel ({what}); expected {PATHS}. Save one with "
            "tf.saved_model.save(obj, path) or model.export(path)"
        )
    return kind


def _load_path(tf: Any, path: Path, signature: str, args: Any) -> Target:
    if _check_path(path) == "keras":
        import keras

        try:
            model = keras.models.load_model(str(path), compile=False)
        except Exception as exc:
            raise ExportError(
                f"{path}: Keras cannot load it ({type(exc).__name__}: {exc}). Custom layers "
                "must be registered (keras.saving.register_keras_serializable) and imported"
            ) from None
        return _keras_target(tf, model, args)
    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as exc:
        raise ExportError(f"{path}: TensorFlow cannot load the SavedModel: {exc}") from None
    return _savedmodel_target(tf, loaded, signature, f"SavedModel {path}")


def target_of(model: Any, args: Any = None, signature: str = "serving_default") -> Target:
    """Reduce whatever was given to a :class:`Target` (imports TensorFlow)."""
    if isinstance(model, (str, os.PathLike)):
        _check_path(Path(model))
    tf = _tf()
    if isinstance(model, (str, os.PathLike)):
        return _load_path(tf, Path(model), signature, args)
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(model, keras.Model):
        return _keras_target(tf, model, args)
    if isinstance(model, tf.types.experimental.ConcreteFunction):
        return _concrete_target(tf, model, "concrete function")
    if isinstance(model, tf.types.experimental.GenericFunction):
        return _function_target(tf, model, args)
    if isinstance(model, tf.Module):
        return _savedmodel_target(tf, model, signature, "the SavedModel object")
    raise ExportError(f"cannot export a {type(model).__name__} with the TensorFlow exporter")


def _as_arrays(args: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Example inputs as numpy arrays by name (a dict keeps its keys)."""
    if isinstance(args, Mapping):
        return {str(k): np.asarray(v) for k, v in args.items()}
    items = list(args) if isinstance(args, (list, tuple)) else [args]
    taken: set[str] = set()
    out = {}
    for i, a in enumerate(items):
        hint = names[i] if i < len(names) else f"input_{i}"
        out[_clean(hint, taken)] = np.asarray(a)
    return out


def _match_dtypes(examples: dict[str, np.ndarray], target: Target) -> dict[str, np.ndarray]:
    """Example inputs in the model's dtypes: floats are cast (numpy makes float64 by default),
    anything else must already match."""
    out = {}
    for (name, a), dtype in zip(examples.items(), target.dtypes):
        want = np.dtype(dtype.as_numpy_dtype)
        if a.dtype != want:
            if not (a.dtype.kind == "f" and want.kind == "f"):
                raise ExportError(
                    f"example input {name!r} is {a.dtype}; the {target.what} takes {want}"
                )
            a = a.astype(want)
        out[name] = a
    return out


# -- export ------------------------------------------------------------------------------------


def _symbols(
    target: Target, dynamic_batch: bool, dynamic_dims: Mapping[str, Mapping[int, str]] | None
) -> list[dict[int, str]]:
    """Per input: axis -> symbolic dim name, for every dim the exported model leaves open."""
    unknown = set(dynamic_dims or {}) - set(target.names)
    if unknown:
        raise ExportError(
            f"dynamic_dims name {sorted(unknown)}, which are not inputs of the "
            f"{target.what} ({', '.join(target.names)})"
        )
    axes = []
    for name, shape in zip(target.names, target.shapes):
        dims = dict((dynamic_dims or {}).get(name, {}))
        if dynamic_batch and shape:
            dims.setdefault(0, "batch")
        out = {}
        for axis, sym in dims.items():
            if not -len(shape) <= axis < len(shape):
                raise ExportError(
                    f"dynamic_dims[{name!r}] names axis {axis}; the input has rank {len(shape)}"
                )
            axis %= len(shape)
            if shape[axis] is not None and not target.relaxable:
                raise ExportError(
                    f"the {target.what} fixes dim {axis} of input {name!r} to {shape[axis]}; it "
                    "cannot be made dynamic after tracing. Export the Python tf.function or "
                    "Keras model instead, or pass dynamic_batch=False"
                )
            out[axis] = sym
        axes.append(out)
    return axes


def _export_shapes(
    target: Target, axes: list[dict[int, str]], examples: Mapping[str, np.ndarray] | None
) -> list[tuple[int | None, ...]]:
    """The traced signature: open where asked, an example's size or the declared size elsewhere."""
    shapes = []
    for i, (name, shape) in enumerate(zip(target.names, target.shapes)):
        given = examples[name].shape if examples is not None else None
        if given is not None and len(given) != len(shape):
            raise ExportError(
                f"example input {name!r} has rank {len(given)}; the {target.what} takes rank "
                f"{len(shape)} {shape}"
            )
        out: list[int | None] = []
        for axis, d in enumerate(shape):
            if axis in axes[i]:
                out.append(None)
            elif given is not None and (d is None or target.relaxable):
                out.append(int(given[axis]))
            elif d is None:
                axes[i][axis] = f"{name}_dim{axis}"  # left open by the model; name it
                out.append(None)
            else:
                out.append(d)
        shapes.append(tuple(out))
    return shapes


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
    signature: str = "serving_default",
) -> Path:
    """Export a TensorFlow model to ``path`` and check it against TensorFlow at two sizes of its
    dynamic dims.

    Args:
        model: a tf.function, ConcreteFunction, Keras model, loaded SavedModel, SavedModel
            directory or ``.keras`` file.
        args: example inputs (an array, a sequence in input order, or a dict by input name);
            optional when the model declares its inputs. They fix the dims that are not made
            dynamic and are the first inputs the check runs.
        dynamic_batch: make dim 0 of every input the symbolic ``batch``.
        dynamic_dims: more symbolic dims by input name: ``{"ids": {1: "seq"}}``.
        output_names: names of the outputs (default: the model's own names, else ``output``
            or ``output_0``, ``output_1``...).
        opset: ONNX opset, 9..18 (default 18; tf2onnx converts to 18 at most).
        check: run the ONNX model on ONNX Runtime and compare with TensorFlow.
        signature: which signature of a SavedModel to export.
    """
    opset = MAX_OPSET if opset is None else int(opset)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(
            f"opset {opset}: tf2onnx converts to opsets {MIN_OPSET}..{MAX_OPSET}; convert the "
            "result later with enginekit.passes.convert_opset if a backend needs another"
        )
    target = target_of(model, args, signature)
    examples = None if args is None else _as_arrays(args, target.names)
    if examples is not None and list(examples) != list(target.names):
        if sorted(examples) == sorted(target.names):
            examples = {n: examples[n] for n in target.names}
        elif len(examples) == len(target.names) and not isinstance(args, Mapping):
            examples = dict(zip(target.names, examples.values()))
        else:
            raise ExportError(
                f"example inputs {', '.join(examples)} for the {target.what}, which takes "
                f"{len(target.names)}: {', '.join(target.names)}"
            )
    if examples is not None:
        examples = _match_dtypes(examples, target)
    axes = _symbols(target, dynamic_batch, dynamic_dims)
    shapes = _export_shapes(target, axes, examples)

    from enginekit.export._tf2onnx import check_outputs, convert  # needs TensorFlow imported

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with held_output("TensorFlow export"):  # C++ logs once TF is already loaded
        proto, fn, names = convert(target, shapes, axes, opset, output_names)
        if check:
            check_outputs(proto, fn, target, shapes, axes, examples, names, atol, rtol)
    with atomic_path(path, suffix=".onnx") as tmp:
        onnx.save_model(proto, str(tmp))
    log.info("exported %s (%d inputs, %d outputs)", path, len(target.names), len(names))
    return path
