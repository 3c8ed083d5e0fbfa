"""The TensorFlow exporter's conversion and check: trace, tf2onnx, repair, compare.

:mod:`enginekit.export.tensorflow` reduces what it is given to a :class:`Target` and hands it
here. Importing this module is cheap: TensorFlow is taken from ``sys.modules`` and tf2onnx is
imported by :func:`convert`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from enginekit.errors import ExportError
from enginekit.quiet import ort_severity, quiet_onnxruntime

log = logging.getLogger("enginekit.export.tensorflow")

#: Variables past this make a protobuf over 2 GiB, which tf2onnx writes only in its own format.
_MAX_BYTES = (2 << 30) - (64 << 20)
#: Default sizes of dynamic dims for the check when no example inputs are given.
_BATCH_SIZE, _OTHER_SIZE = 1, 4


@dataclasses.dataclass(frozen=True)
class Target:
    """A TensorFlow callable reduced to flat, named inputs.

    Attributes:
        call: flat input tensors, in ``names`` order -> the model's output structure.
        names: input names (become the ONNX input names).
        dtypes: TensorFlow dtypes of the inputs.
        shapes: declared shapes; None marks a dim the model leaves open.
        relaxable: ``call`` may be traced with dims its declaration fixes (it is Python code,
            not an already traced graph).
        output_names: the names the model gives its outputs, when it does.
        what: a description for messages.
    """

    call: Callable[..., Any]
    names: tuple[str, ...]
    dtypes: tuple[Any, ...]
    shapes: tuple[tuple[int | None, ...], ...]
    relaxable: bool
    output_names: tuple[str, ...] | None
    what: str


@contextlib.contextmanager
def _quiet(errors: list[str]) -> Iterator[None]:
    """Silence TensorFlow's and tf2onnx's Python logs; collect tf2onnx's errors in ``errors``."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    handler = Collect(logging.ERROR)
    tf2onnx_log = logging.getLogger("tf2onnx")
    tf_log = logging.getLogger("tensorflow")
    saved = (tf2onnx_log.level, tf2onnx_log.propagate, tf_log.level)
    tf2onnx_log.addHandler(handler)
    tf2onnx_log.setLevel(logging.ERROR)
    tf2onnx_log.propagate = False
    tf_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tf2onnx_log.removeHandler(handler)
        tf2onnx_log.setLevel(saved[0])
        tf2onnx_log.propagate = saved[1]
        tf_log.setLevel(saved[2])


_RANDOM = re.compile(r"Random|Multinomial|TruncatedNormal")


def _flatten(tf: Any, out: Any) -> tuple[list[str] | None, list[Any]]:
    if isinstance(out, Mapping):
        keys, values = [str(k) for k in out], list(out.values())
    else:
        keys, values = None, tf.nest.flatten(out)
    if not values or not all(isinstance(v, tf.Tensor) for v in values):
        raise ExportError(
            f"the model returned {type(out).__name__} {out!r:.200}; expected tensors (a tensor, "
            "a list or tuple of tensors, or a dict of tensors)"
        )
    return keys, values


def _output_names(
    keys: list[str] | None,
    model_names: Sequence[str] | None,
    user_names: Sequence[str] | None,
    count: int,
) -> list[str]:
    if user_names is not None:
        if len(user_names) != count or len(set(user_names)) != count:
            raise ExportError(
                f"output_names {list(user_names)}: the model returns {count} outputs; give "
                f"{count} distinct names"
            )
        return list(user_names)
    if keys is not None:
        return keys
    if model_names is not None and len(model_names) == count == len(set(model_names)):
        return list(model_names)
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def _refuse_random(concrete: Any, what: str) -> None:
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    random = [f"{n.op} ({n.name})" for n in nodes if _RANDOM.search(n.op)]
    if random:
        raise ExportError(
            f"the {what} draws random numbers: {', '.join(random[:3])}; an ONNX engine cannot "
            "reproduce them. Usually that is a model in training mode (Dropout, GaussianNoise): "
            "call Keras layers and models with training=False inside the function (enginekit "
            "does so itself when given the Keras model)"
        )


def _check_size(concrete: Any, what: str) -> None:
    total = sum(v.shape.num_elements() * v.dtype.size for v in concrete.variables)
    if total > _MAX_BYTES:
        raise ExportError(
            f"the {what} holds {total / 2**30:.1f} GiB of variables; ONNX files over 2 GiB "
            "need external data, which this exporter does not write yet. Use tf2onnx's CLI "
            "with --large_model, then pass the .onnx to build()"
        )


def _captured_constants(tf: Any, concrete: Any, count: int) -> dict[str, np.ndarray]:
    """Eager tensors (not variables) the function captured, by the name of their placeholder.

    tf2onnx freezes captured variables into initializers but leaves captured eager tensors as
    placeholders, which become extra graph inputs; their values are known here.
    """
    placeholders = list(concrete.inputs[count:])
    values = list(concrete.captured_inputs)
    if len(placeholders) != len(values):
        return {}
    return {
        p.name: v.numpy()
        for p, v in zip(placeholders, values)
        if p.dtype != tf.resource and hasattr(v, "numpy")
    }


def _inline_captures(
    proto: onnx.ModelProto, captured: Mapping[str, np.ndarray], names: Sequence[str], what: str
) -> None:
    extra = [v for v in proto.graph.input if v.name not in names]
    for v in extra:
        if v.name not in captured:
            raise ExportError(
                f"tf2onnx made {v.name!r} an extra input of the ONNX model: the {what} reads a "
                "tensor from outside that was not frozen into a constant. Hold such values in "
                "tf.Variable objects or create them inside the function"
            )
        proto.graph.initializer.append(numpy_helper.from_array(captured[v.name], v.name))
        log.info("captured tensor %s frozen into the model as a constant", v.name)
    keep = [v for v in proto.graph.input if v.name in names]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)


def _refuse_unconverted(proto: onnx.ModelProto, errors: Sequence[str], opset: int) -> None:
    """tf2onnx leaves ops it cannot convert in the graph under their TensorFlow names."""
    bad = []
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            bad.append(node.op_type)
    if bad:
        ops = sorted(set(bad))
        why = [e.strip().splitlines()[0] for e in errors if any(op in e for op in ops)][:3]
        raise ExportError(
            f"tf2onnx cannot convert the TensorFlow op(s) {', '.join(ops)} to ONNX opset "
            f"{opset}" + (f" ({'; '.join(why)})" if why else "") + ". Rewrite that part of the "
            "model with ops ONNX has, or compute it outside the model"
        )


def _name_dims(proto: onnx.ModelProto, axes: Sequence[Mapping[int, str]]) -> None:
    """Give the inputs' open dims their symbolic names (tf2onnx writes unk__N)."""
    renamed: dict[str, str] = {}
    for value, wanted in zip(proto.graph.input, axes):
        dims = value.type.tensor_type.shape.dim
        for axis, sym in wanted.items():
            if dims[axis].dim_param:
                renamed[dims[axis].dim_param] = sym
            dims[axis].Clear()
            dims[axis].dim_param = sym
    for value in list(proto.graph.output) + list(proto.graph.value_info):
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in renamed:
                d.dim_param = renamed[d.dim_param]


def convert(
    target: Target,
    shapes: Sequence[tuple[int | None, ...]],
    axes: Sequence[Mapping[int, str]],
    opset: int,
    output_names: Sequence[str] | None,
) -> tuple[onnx.ModelProto, Any, list[str]]:
    """Trace the target with one flat signature and convert it; returns the ONNX model, the
    traced tf.function (the check's reference) and the output names."""
    import tf2onnx

    tf = sys.modules["tensorflow"]
    sig = [tf.TensorSpec(s, d, name=n) for n, d, s in zip(target.names, target.dtypes, shapes)]
    chosen: list[str] = []

    def named_outputs(*xs: Any) -> dict[str, Any]:
        keys, flat = _flatten(tf, target.call(*xs))
        chosen[:] = _output_names(keys, target.output_names, output_names, len(flat))
        return dict(zip(chosen, flat))

    fn = tf.function(named_outputs, input_signature=sig)
    errors: list[str] = []
    with _quiet(errors):
        try:
            concrete = fn.get_concrete_function()
        except ExportError:
            raise
        except Exception as exc:
            raise ExportError(
                f"TensorFlow cannot trace the {target.what} with inputs "
                f"{dict(zip(target.names, shapes))}: {_summary(exc)}"
            ) from None
        _refuse_random(concrete, target.what)
        _check_size(concrete, target.what)
        try:
            proto, _ = tf2onnx.convert.from_function(fn, input_signature=sig, opset=opset)
        except Exception as exc:
            detail = "; ".join(e.splitlines()[0] for e in errors[-3:])
            raise ExportError(
                f"tf2onnx failed on the {target.what}: {_summary(exc)}"
                + (f" ({detail})" if detail else "")
            ) from None
    _refuse_unconverted(proto, errors, opset)
    _inline_captures(proto, _captured_constants(tf, concrete, len(sig)), target.names, target.what)
    by_name = {o.name: o for o in proto.graph.output}
    if set(by_name) != set(chosen):
        raise ExportError(f"tf2onnx named the outputs {sorted(by_name)}; expected {chosen}")
    ordered = [by_name[n] for n in chosen]
    del proto.graph.output[:]
    proto.graph.output.extend(ordered)
    _name_dims(proto, axes)
    return proto, fn, chosen


_NOISE = ("File ", "Detected at node", "Graph execution error", "[[{{node")


def _summary(exc: BaseException) -> str:
    """The message of an exception without TensorFlow's embedded Python traceback."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith(_NOISE)]
    text = " ".join(" ".join(kept).split())
    text = re.sub(r"\s*\[Op:__inference_[^\]]*\]", "", text)
    return text[:600] or type(exc).__name__


# -- the check against TensorFlow --------------------------------------------------------------


def _sizes(
    names: Sequence[str],
    axes: Sequence[Mapping[int, str]],
    examples: Mapping[str, np.ndarray] | None,
) -> tuple[dict[str, int], dict[str, int]]:
    """Two sizes per symbolic dim: the example's (or a default), then a larger one, distinct
    per symbol so that output dims can be matched to the symbol they follow.

    Dims the model left open and nobody named (``ids_dim1``, ``mask_dim1``) may have to agree
    with each other, so those at the same axis move together.
    """
    first: dict[str, int] = {}
    group: dict[str, Any] = {}
    for name, wanted in zip(names, axes):
        for axis, sym in wanted.items():
            if sym not in first:
                given = examples[name].shape[axis] if examples is not None else None
                first[sym] = int(given) if given else (_BATCH_SIZE if axis == 0 else _OTHER_SIZE)
                group[sym] = ("open", axis) if sym == f"{name}_dim{axis}" else sym
    offsets = {g: i for i, g in enumerate(dict.fromkeys(group.values()))}
    second = {sym: n + 2 + offsets[group[sym]] for sym, n in first.items()}
    return first, second


def _feeds(
    target: Target,
    shapes: Sequence[tuple[int | None, ...]],
    axes: Sequence[Mapping[int, str]],
    size: Mapping[str, int],
    examples: Mapping[str, np.ndarray] | None,
    seed: int,
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, dtype, shape, wanted in zip(target.names, target.dtypes, shapes, axes):
        if examples is not None:
            a = examples[name]
            for axis, sym in wanted.items():
                a = np.take(a, np.arange(size[sym]) % max(a.shape[axis], 1), axis=axis)
            feeds[name] = np.ascontiguousarray(a)
            continue
        dims = tuple(size[wanted[axis]] if d is None else d for axis, d in enumerate(shape))
        np_dtype = np.dtype(dtype.as_numpy_dtype)
        if np_dtype.kind == "f":
            feeds[name] = rng.standard_normal(dims).astype(np_dtype)
        elif np_dtype.kind in "iub":
            feeds[name] = rng.integers(0, 2, dims).astype(np_dtype)
        else:
            raise ExportError(
                f"input {name!r} has dtype {dtype.name}: pass example inputs as args to check it"
            )
    return feeds


def check_outputs(
    proto: onnx.ModelProto,
    fn: Any,
    target: Target,
    shapes: Sequence[tuple[int | None, ...]],
    axes: Sequence[Mapping[int, str]],
    examples: Mapping[str, np.ndarray] | None,
    names: Sequence[str],
    atol: float,
    rtol: float,
) -> None:
    """Compare ONNX Runtime with TensorFlow at two sizes of the dynamic dims; name the outputs'
    dynamic dims after the input dims they follow (in place).

    Raises:
        ExportError: a shape or value mismatch, with the largest difference.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    quiet_onnxruntime()
    so.log_severity_level = ort_severity()
    try:
        session = ort.InferenceSession(
            proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        raise ExportError(f"ONNX Runtime cannot load the exported model: {_summary(exc)}") from None
    sizes = _sizes(target.names, axes, examples)
    seen: list[dict[str, tuple[int, ...]]] = []
    for seed, size in enumerate(sizes if any(axes) else sizes[:1]):
        feeds = _feeds(target, shapes, axes, size, examples, seed)
        at = {n: a.shape for n, a in feeds.items()}
        try:
            expected = {k: v.numpy() for k, v in fn(*feeds.values()).items()}
        except Exception as exc:
            raise ExportError(
                f"TensorFlow itself fails on the {target.what} at input shapes {at}: "
                f"{_summary(exc)}. Dims that must agree need one name: dynamic_dims={{'a': "
                "{1: 'seq'}, 'b': {1: 'seq'}}; a model that works at one size only needs "
                "dynamic_batch=False (and example inputs of that size)"
            ) from None
        try:
            got = dict(zip(names, session.run(list(names), feeds)))
        except Exception as exc:
            raise ExportError(
                f"ONNX Runtime fails on the exported model at input shapes {at}: {_summary(exc)}"
            ) from None
        _compare(expected, got, at, atol, rtol)
        seen.append({n: got[n].shape for n in names})
    if len(seen) == 2:
        _name_output_dims(proto, seen, sizes)


def _compare(
    expected: Mapping[str, np.ndarray],
    got: Mapping[str, np.ndarray],
    at: Mapping[str, tuple[int, ...]],
    atol: float,
    rtol: float,
) -> None:
    worst = (0.0, "")
    for name, g in got.items():
        e = expected[name]
        if e.shape != g.shape:
            raise ExportError(
                f"the ONNX model's output {name!r} has shape {g.shape}, TensorFlow gives "
                f"{e.shape} (input shapes {at}): a dynamic dim was baked in"
            )
        if e.dtype.kind not in "fc":
            if not np.array_equal(e, g):
                raise ExportError(f"output {name!r} differs from TensorFlow at {at}")
            continue
        diff = np.abs(e.astype(np.float64) - g.astype(np.float64))
        if diff.size and float(np.nanmax(diff)) > worst[0]:
            worst = (float(np.nanmax(diff)), name)
        bad = ~(diff <= atol + rtol * np.abs(e.astype(np.float64)))
        if np.any(bad & ~(np.isnan(e) & np.isnan(g))):
            raise ExportError(
                f"the ONNX model does not match TensorFlow: output {name!r} differs by up to "
                f"{float(np.nanmax(diff)):.3g} (atol={atol}, rtol={rtol}) at input shapes {at}"
            )
    log.info("export check at %s: largest difference %.3g (%s)", dict(at), *worst)


def _name_output_dims(
    proto: onnx.ModelProto,
    seen: Sequence[Mapping[str, tuple[int, ...]]],
    sizes: tuple[dict[str, int], dict[str, int]],
) -> None:
    by_pair: dict[tuple[int, int], str] = {}
    for sym in sizes[0]:
        by_pair.setdefault((sizes[0][sym], sizes[1][sym]), sym)
    for value in proto.graph.output:
        dims = value.type.tensor_type.shape.dim
        first, second = seen[0][value.name], seen[1][value.name]
        if len(dims) != len(first):
            del dims[:]
            dims.extend(onnx.TensorShapeProto.Dimension() for _ in first)
        for axis, (a, b) in enumerate(zip(first, second)):
            if a == b:
                continue
            dims[axis].Clear()
            dims[axis].dim_param = by_pair.get((a, b), f"{value.name}_dim{axis}")
