"""Triton Inference Server model repository entries from engine artifacts.

``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/<version>/``: ONNX Runtime engines become
Triton's own ``onnxruntime_onnx`` models (the payload ``model.onnx``), TensorRT engines
``tensorrt_plan`` models (``model.plan``); every other backend runs in Triton's Python backend
through a generated ``model.py`` that loads the artifact with enginekit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from enginekit.errors import ArtifactError, EnginekitError
from enginekit.files import atomic_dir, atomic_write

#: numpy dtype name -> Triton DataType.
DATA_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
    "str": "TYPE_STRING",
    "object": "TYPE_STRING",
    "string": "TYPE_STRING",
}

#: Used when the engine is batched but was built without profiles (any batch size).
DEFAULT_MAX_BATCH = 32


@dataclasses.dataclass(frozen=True)
class TritonTensor:
    """One input or output as Triton sees it (dims without the batch dim when batched)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TritonModel:
    """What goes into config.pbtxt, and which payload file becomes the version's model file."""

    name: str
    platform: str | None
    backend: str | None
    max_batch_size: int
    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    instance_kind: str
    instance_count: int
    model_file: str
    notes: tuple[str, ...] = ()


def _data_type(name: str, dtype: str) -> str:
    if dtype not in DATA_TYPES:
        raise EnginekitError(f"tensor {name!r}: dtype {dtype} has no Triton data type")
    return DATA_TYPES[dtype]


def _batched(manifest: Mapping[str, Any]) -> bool:
    """All inputs and outputs share one symbolic leading dim (as Engine splits batches on)."""
    specs = list(manifest["inputs"]) + list(manifest["outputs"])
    first = [s["shape"][0] if s["shape"] else None for s in specs]
    return bool(first) and isinstance(first[0], str) and all(d == first[0] for d in first)


def _dims(
    spec: Mapping[str, Any], profiles: Sequence[Mapping[str, Any]], batched: bool
) -> tuple[int, ...]:
    """Fixed dims as they are; a symbolic dim that every profile fixes to one size takes that
    size; others are -1 (variable)."""
    dims = []
    for axis, d in enumerate(spec["shape"]):
        if batched and axis == 0:
            continue
        if isinstance(d, int):
            dims.append(d)
            continue
        sizes = {
            (p[spec["name"]][0][axis], p[spec["name"]][2][axis])
            for p in profiles
            if spec["name"] in p
        }
        if profiles and len(sizes) == 1 and len({*next(iter(sizes))}) == 1:
            dims.append(next(iter(sizes))[0])
        else:
            dims.append(-1)
    return tuple(dims)


def plan_model(
    manifest: Mapping[str, Any],
    name: str,
    max_batch_size: int | None = None,
    max_queue_delay_us: int = 100,
    instance_count: int = 1,
) -> TritonModel:
    """The Triton model for an artifact's manifest (no files written).

    Raises:
        EnginekitError: a dtype Triton has no type for; a max batch size below 1.
    """
    backend = manifest["backend"]["name"]
    payload = list(manifest.get("payload", {}))
    profiles = manifest.get("profiles") or []
    batched = _batched(manifest)
    notes = []
    if backend == "onnxruntime" and "model.onnx" in payload:
        platform, tbackend, model_file = "onnxruntime_onnx", None, "model.onnx"
        level = (manifest["backend"].get("metadata") or {}).get("optimization_level")
        if level == "all":
            notes.append(
                "model.onnx was optimized at level 'all' for this CPU (layout-specific ops); "
                "for other hosts or GPU instances build with optimization_level = 'extended'"
            )
    elif backend == "tensorrt" and any(p.endswith(".plan") for p in payload):
        platform, tbackend, model_file = "tensorrt_plan", None, "model.plan"
        notes.append("a TensorRT plan runs only with the TensorRT version and GPU it was built for")
    else:
        platform, tbackend, model_file = None, "python", "model.py"
        notes.append(
            f"{backend} engines run in Triton's Python backend: install enginekit (and the "
            f"{backend} runtime) in the Python backend's environment"
        )
    if batched:
        if max_batch_size is None:
            maxes = [
                min(p[s["name"]][2][0] for s in manifest["inputs"] if s["name"] in p)
                for p in profiles
                if p
            ]
            max_batch_size = max(maxes) if maxes else DEFAULT_MAX_BATCH
            if not maxes:
                notes.append(f"no profiles: max_batch_size set to {DEFAULT_MAX_BATCH}")
        if max_batch_size < 1:
            raise EnginekitError(f"max_batch_size {max_batch_size}: expected >= 1")
        opts = sorted(
            {
                min(p[s["name"]][1][0] for s in manifest["inputs"] if s["name"] in p)
                for p in profiles
                if p
            }
        )
        preferred = tuple(b for b in opts if 1 < b <= max_batch_size)
    else:
        max_batch_size, preferred = 0, ()
    inputs = tuple(
        TritonTensor(s["name"], _data_type(s["name"], s["dtype"]), _dims(s, profiles, batched))
        for s in manifest["inputs"]
    )
    outputs = tuple(
        TritonTensor(s["name"], _data_type(s["name"], s["dtype"]), _dims(s, (), batched))
        for s in manifest["outputs"]
    )
    device = str((manifest.get("config") or {}).get("device", "cpu"))
    return TritonModel(
        name=name,
        platform=platform,
        backend=tbackend,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        preferred_batch_sizes=preferred,
        max_queue_delay_us=max_queue_delay_us,
        instance_kind="KIND_GPU" if device.startswith("cuda") else "KIND_CPU",
        instance_count=instance_count,
        model_file=model_file,
        notes=tuple(notes),
    )


def _q(text: str) -> str:
    return json.dumps(text)  # a protobuf text-format string literal is JSON-compatible here


def _tensor(t: TritonTensor) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    return f"  {{\n    name: {_q(t.name)}\n    data_type: {t.data_type}\n    dims: [ {dims} ]\n  }}"


def config_pbtxt(model: TritonModel) -> str:
    """The model's ``config.pbtxt`` (protobuf text format of Triton's ModelConfig)."""
    lines = [f"name: {_q(model.name)}"]
    if model.platform:
        lines.append(f"platform: {_q(model.platform)}")
    if model.backend:
        lines.append(f"backend: {_q(model.backend)}")
    lines.append(f"max_batch_size: {model.max_batch_size}")
    lines.append("input [\n" + ",\n".join(_tensor(t) for t in model.inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(_tensor(t) for t in model.outputs) + "\n]")
    if model.max_batch_size > 0:
        batching = ["dynamic_batching {"]
        if model.preferred_batch_sizes:
            sizes = ", ".join(map(str, model.preferred_batch_sizes))
            batching.append(f"  preferred_batch_size: [ {sizes} ]")
        batching.append(f"  max_queue_delay_microseconds: {model.max_queue_delay_us}")
        batching.append("}")
        lines.append("\n".join(batching))
    lines.append(
        f"instance_group [\n  {{\n    count: {model.instance_count}\n    kind: "
        f"{model.instance_kind}\n  }}\n]"
    )
    return "\n".join(lines) + "\n"


MODEL_PY = '''"""Triton Python backend model written by `enginekit export-triton`: runs model.ekit through
enginekit (which must be installed in the Python backend's environment, with the engine's
backend runtime)."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

import enginekit


class TritonPythonModel:
    def initialize(self, args):
        here = Path(args["model_repository"]) / args["model_version"]
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = "cuda:" + str(args.get("model_instance_device_id", 0))
        self.engine = enginekit.load(here / "model.ekit", device=device)
        self.inputs = [s.name for s in self.engine.inputs]
        self.outputs = [s.name for s in self.engine.outputs]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                feeds = {
                    name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in self.inputs
                }
                result = self.engine.infer(feeds)
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(result[name]))
                    for name in self.outputs
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not take the model down
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
                    )
                )
        return responses

    def finalize(self):
        self.engine.close()
'''


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def export_triton(
    artifact: str | os.PathLike,
    repo: str | os.PathLike,
    name: str | None = None,
    version: int = 1,
    max_batch_size: int | None = None,
    max_queue_delay_us: int = 100,
    instance_count: int = 1,
) -> dict[str, Any]:
    """Write a Triton model repository entry for an engine artifact.

    Args:
        artifact: the ``.ekit`` file or artifact directory.
        repo: the model repository folder (created if missing).
        name: the Triton model name (default: the artifact's file stem).
        version: the version folder to write (an existing one is replaced).
        max_batch_size: override the profiles' largest batch.
        max_queue_delay_us: dynamic batching's queue delay.
        instance_count: model instances.

    Returns:
        ``{"model_dir", "config", "files", "platform", "backend", "max_batch_size", "notes"}``.

    Raises:
        ArtifactError: the artifact is missing or corrupt.
        EnginekitError: a bad name, version or a dtype Triton lacks.
    """
    from enginekit.artifact import open_artifact

    src = Path(artifact)
    opened = open_artifact(src)
    name = name or src.stem
    if not _NAME.fullmatch(name):
        raise EnginekitError(f"Triton model name {name!r}: use letters, digits, '_', '.', '-'")
    if version < 1:
        raise EnginekitError(f"version {version}: Triton versions are integers >= 1")
    model = plan_model(opened.manifest, name, max_batch_size, max_queue_delay_us, instance_count)
    model_dir = Path(repo) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    with atomic_dir(model_dir / str(version)) as staging:
        if model.backend == "python":
            (staging / "model.py").write_text(MODEL_PY, encoding="utf-8")
            if src.is_dir():
                shutil.copytree(src, staging / "model.ekit")
            else:
                shutil.copyfile(src, staging / "model.ekit")
        else:
            payload = next(
                (p for p in opened.payload_names if p == model.model_file or p.endswith(".plan")),
                None,
            )
            if payload is None:
                raise ArtifactError(f"{src}: no {model.model_file} in its payload")
            (staging / model.model_file).write_bytes(opened.read(payload))
    config = model_dir / "config.pbtxt"
    with atomic_write(config, "w") as f:
        f.write(config_pbtxt(model))
    files = sorted(p.name for p in (model_dir / str(version)).iterdir())
    return {
        "model_dir": str(model_dir),
        "config": str(config),
        "files": ["config.pbtxt", *(f"{version}/{f}" for f in files)],
        "platform": model.platform,
        "backend": model.backend,
        "max_batch_size": model.max_batch_size,
        "notes": list(model.notes),
    }
