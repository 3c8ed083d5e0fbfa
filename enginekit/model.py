"""The ONNX model as enginekit sees it: safe loading, IO specs, content hash, random feeds."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx

from enginekit.config import ShapeProfile
from enginekit.engine import TensorSpec
from enginekit.errors import BuildError, ModelError, did_you_mean
from enginekit.quiet import ort_severity, quiet_onnxruntime

log = logging.getLogger(__name__)

ModelSource = Union[str, os.PathLike, onnx.ModelProto, "Model"]

#: Above this size a model is written with its weights as external data (protobuf caps at 2 GiB).
_EXTERNAL_DATA_BYTES = 1 << 30


def _external_locations(proto: onnx.ModelProto) -> list[str]:
    locations = []
    for tensor in _all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entry = {e.key: e.value for e in tensor.external_data}
            locations.append(entry.get("location", ""))
    return sorted(set(locations))


def _all_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(proto))


def _check_location(model_dir: Path, location: str, model_path: Path) -> Path:
    root = model_dir.resolve()
    target = (model_dir / location).resolve()
    if os.path.isabs(location) or (target != root and root not in target.parents):
        raise ModelError(
            f"{model_path}: external data path {location!r} escapes the model's folder "
            f"{root}; refusing to read it. Keep external data files next to the model."
        )
    if not target.is_file():
        raise ModelError(
            f"{model_path}: external data file {location!r} is missing (looked in {model_dir})"
        )
    return target


def _spec_of(value: onnx.ValueInfoProto) -> TensorSpec:
    ttype = value.type.tensor_type
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)).name
    except (KeyError, TypeError, ValueError):
        dtype = onnx.TensorProto.DataType.Name(ttype.elem_type).lower()
    dims: list[int | str] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append("?")
    return TensorSpec(value.name, dtype, tuple(dims))


def io_specs(proto: onnx.ModelProto) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Input and output specs of a model; initializers listed as inputs (old exporters) are skipped."""
    init = {t.name for t in proto.graph.initializer}
    inputs = tuple(_spec_of(v) for v in proto.graph.input if v.name not in init)
    outputs = tuple(_spec_of(v) for v in proto.graph.output)
    return inputs, outputs


@dataclasses.dataclass(frozen=True)
class Model:
    """An ONNX model loaded with its weights, its IO specs and its content hash.

    Attributes:
        proto: the ModelProto, external data loaded in.
        path: the file it came from, if any.
        sha256: SHA-256 of the model content (the file and its external data files).
    """

    proto: onnx.ModelProto
    path: Path | None
    sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def opset(self) -> int:
        """The model's ai.onnx opset version."""
        return next((o.version for o in self.proto.opset_import if o.domain in ("", "ai.onnx")), 0)

    @property
    def ops(self) -> list[tuple[str, str]]:
        """(domain, op_type) of every node of the main graph, in order."""
        return [(n.domain or "ai.onnx", n.op_type) for n in self.proto.graph.node]

    @property
    def label(self) -> str:
        """How messages name the model: its file, or its graph's name."""
        return str(self.path) if self.path else f"model {self.proto.graph.name or '(unnamed)'!r}"

    def to_bytes(self) -> bytes:
        """The serialized model (weights inline)."""
        return self.proto.SerializeToString()

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model; weights go to ``<name>.data`` beside it when the model is large."""
        path = Path(path)
        large = self.proto.ByteSize() > _EXTERNAL_DATA_BYTES
        onnx.save_model(
            self.proto,
            str(path),
            save_as_external_data=large,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
        )
        return path


def _hash_file(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def load_model(source: ModelSource) -> Model:
    """Load an ONNX model from a path, a ModelProto or a Model.

    External data is read only from inside the model's own folder.

    Raises:
        ModelError: the file is missing, not ONNX, or its external data escapes its folder.
    """
    if isinstance(source, Model):
        return source
    if isinstance(source, onnx.ModelProto):
        digest = hashlib.sha256(source.SerializeToString(deterministic=True)).hexdigest()
        inputs, outputs = io_specs(source)
        return Model(source, None, digest, inputs, outputs)
    path = Path(source)
    if not path.is_file():
        raise ModelError(f"{path}: no such ONNX file")
    try:
        proto = onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ModelError(
            f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})"
        ) from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelError(f"{path}: the file parsed but holds no graph; is it an ONNX model?")
    h = hashlib.sha256()
    _hash_file(h, path)
    locations = _external_locations(proto)
    for location in locations:
        _hash_file(h, _check_location(path.parent, location, path))
    if locations:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(proto, str(path.parent))
    inputs, outputs = io_specs(proto)
    return Model(proto, path, h.hexdigest(), inputs, outputs)


# -- concrete shapes and random feeds ----------------------------------------------------------


def concrete_shapes(
    specs: Sequence[TensorSpec],
    profile: Mapping[str, ShapeProfile] | None,
    point: str = "opt",
    batch: int = 1,
    dims: Mapping[str, int] | None = None,
) -> dict[str, tuple[int, ...]]:
    """One concrete shape per input: the profile's ``point`` (min/opt/max) where it names the
    input, else the spec with ``batch`` for a leading symbolic dim and ``dims`` for named ones.

    Raises:
        BuildError: a symbolic dim has no value; the message says to pass shapes.
    """
    out: dict[str, tuple[int, ...]] = {}
    for s in specs:
        if profile and s.name in profile:
            out[s.name] = tuple(getattr(profile[s.name], point))
            continue
        shape = []
        for axis, d in enumerate(s.shape):
            if isinstance(d, int):
                shape.append(d)
            elif dims and d in dims:
                shape.append(dims[d])
            elif axis == 0:
                shape.append(batch)
            else:
                raise BuildError(
                    f"input {s.name!r} dim {axis} is dynamic ({d!r}); give its range with "
                    f"shapes={{'{s.name}': [min, opt, max]}} (CLI: --shapes {s.name}:AxB,CxD,ExF)"
                )
        out[s.name] = tuple(shape)
    return out


def random_feeds(
    specs: Sequence[TensorSpec], shapes: Mapping[str, tuple[int, ...]], seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs of the given shapes: normal floats, 0/1 integers (safe as ids and masks),
    short words for string tensors."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in specs:
        dtype = np.dtype(s.dtype)
        shape = shapes[s.name]
        if dtype.kind == "f":
            feeds[s.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[s.name] = rng.integers(0, 2, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[s.name] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.kind in "OUS":  # ONNX string tensors: short lowercase words
            words = np.array(["alpha", "beta", "gamma", "delta", "monday", "the", "a"], object)
            # np.asarray: indexing with a 0-d index array gives a bare str, not an array
            feeds[s.name] = np.asarray(words[rng.integers(0, len(words), shape)], dtype=object)
        else:
            raise BuildError(f"input {s.name!r}: cannot make random data of dtype {s.dtype}")
    return feeds


def reference_session(model: Model, threads: int = 0) -> Any:
    """An ONNX Runtime CPU session on the model, basic optimizations only: the reference."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.intra_op_num_threads = threads
    quiet_onnxruntime()
    opts.log_severity_level = ort_severity()
    try:
        return ort.InferenceSession(model.to_bytes(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"ONNX Runtime cannot load the model: {exc}") from None


def _check_shared_dims(
    index: int, profile: dict[str, ShapeProfile], specs: dict[str, TensorSpec]
) -> None:
    """A symbolic dim the model shares between inputs (``seq`` of input_ids and attention_mask)
    is one size at run time, so its range must be the same in every input of the profile."""
    uses: dict[str, list[tuple[str, int, tuple[int, int, int]]]] = {}
    for name, prof in profile.items():
        for axis, d in enumerate(specs[name].shape):
            if isinstance(d, str) and axis < len(prof.min):
                rng = (prof.min[axis], prof.opt[axis], prof.max[axis])
                uses.setdefault(d, []).append((name, axis, rng))
    for dim, found in uses.items():
        if len({r for _, _, r in found}) > 1:
            given = "; ".join(f"{n} dim {a}: {lo},{opt},{hi}" for n, a, (lo, opt, hi) in found)
            raise BuildError(
                f"profile {index}: inputs share the dim {dim!r} but their shapes give it different "
                f"ranges ({given}); give every input the same min, opt and max for {dim!r}"
            )


def check_profiles(model: Model, profiles: tuple[dict[str, ShapeProfile], ...]) -> None:
    """Every profile names real inputs, with their rank and fixed dims, and all profiles cover
    the same inputs.

    Raises:
        BuildError: naming the input and dim at fault.
    """
    specs = {s.name: s for s in model.inputs}
    covered = None
    for i, p in enumerate(profiles):
        for name, prof in p.items():
            if name not in specs:
                raise BuildError(
                    f"shapes name input {name!r}, which the model does not have"
                    f"{did_you_mean(name, specs)} (inputs: {', '.join(specs)})"
                )
            spec = specs[name]
            if len(prof.min) != len(spec.shape):
                raise BuildError(
                    f"shapes for {name!r} have rank {len(prof.min)}; the model's input is "
                    f"rank {len(spec.shape)} {spec.shape}"
                )
            for axis, d in enumerate(spec.shape):
                if isinstance(d, int) and not prof.min[axis] == prof.max[axis] == d:
                    hint = (
                        "; make the batch dim symbolic first: enginekit prepare MODEL -o "
                        "OUT.onnx --batch-dynamic (or passes.make_batch_dynamic), or give "
                        f"{name} dim 0 as {d} in every shape"
                        if axis == 0
                        else f"; give {d} for that dim in every shape"
                    )
                    raise BuildError(
                        f"shapes for {name!r} dim {axis}: the model fixes it to {d}, the "
                        f"profile gives {prof.min[axis]}..{prof.max[axis]}{hint}"
                    )
        _check_shared_dims(i, p, specs)
        if covered is not None and set(p) != covered:
            raise BuildError(
                f"profile {i} covers inputs {sorted(p)}, profile 0 covers {sorted(covered)}; "
                "every profile must cover the same inputs"
            )
        covered = set(p)
