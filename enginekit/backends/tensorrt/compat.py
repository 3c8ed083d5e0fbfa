"""Whether a TensorRT artifact can load here: checked from its manifest before TensorRT sees it.

A serialized TensorRT plan loads only in the TensorRT version that built it, on a GPU of the
compute capability it was built for (unless built version- or hardware-compatible). TensorRT's
own refusal is an opaque deserialization error; this check says what differs and which command
rebuilds the engine from the source model recorded in the manifest. Pure Python.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from typing import Any

from enginekit.backends.tensorrt.plan import parse_version
from enginekit.errors import ArtifactError

log = logging.getLogger(__name__)


def rebuild_command(manifest: Mapping[str, Any], output: str) -> str:
    """The ``enginekit build`` command that rebuilds this artifact from its source model."""
    config = manifest.get("config", {})
    source = (manifest.get("source") or {}).get("path") or "<model.onnx>"
    parts = ["enginekit", "build", source, "--backend", str(config.get("backend", "tensorrt"))]
    for profile in config.get("profiles", []):
        for name, shapes in profile.items():
            text = ",".join("x".join(str(d) for d in s) for s in shapes)
            parts += ["--shapes", f"{name}:{text}"]
    parts += ["--precision", str(config.get("precision", "fp32"))]
    parts += ["--device", str(config.get("device", "cuda"))]
    for key, value in (config.get("options") or {}).items():
        if key == "timing_cache":
            parts += ["--timing-cache", str(value)]
        else:
            parts += ["-O", f"{key}={_json(value)}"]
    parts += ["-o", output]
    return " ".join(shlex.quote(p) for p in parts)


def _json(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


def check_loadable(
    manifest: Mapping[str, Any],
    trt_version: str,
    compute_capability: str,
    gpu_name: str,
    path: str,
) -> list[str]:
    """Refuse an artifact this TensorRT or GPU cannot load; return warnings for what may work.

    Args:
        manifest: the artifact's manifest.
        trt_version: the TensorRT version installed here.
        compute_capability: this GPU's, e.g. ``"8.6"``.
        gpu_name: this GPU's name.
        path: the artifact path (for messages and the rebuild command).

    Raises:
        ArtifactError: built by another TensorRT version or for another compute capability
            (beyond what its compatibility options allow), naming both and the rebuild command.
    """
    target = manifest.get("target") or {}
    built_version = target.get("tensorrt")
    built_cc = target.get("compute_capability")
    if not built_version or not built_cc:
        raise ArtifactError(
            f"{path}: the manifest lacks the TensorRT version or compute capability it was built "
            f"for (target: {dict(target)}); it was not written by enginekit's tensorrt backend. "
            f"Rebuild it: {rebuild_command(manifest, path)}"
        )
    problems = []
    built = parse_version(built_version)
    here = parse_version(trt_version)
    if target.get("version_compatible"):
        if built[0] != here[0] or here < built:
            problems.append(
                f"it was built version-compatible with TensorRT {built_version}, which later "
                f"TensorRT {built[0]}.x runtimes load; this machine has TensorRT {trt_version}"
            )
    elif built != here:
        problems.append(
            f"it was built with TensorRT {built_version} and this machine has TensorRT "
            f"{trt_version}; a TensorRT plan loads only in the version that built it (build "
            "with -O version_compatible=true for plans that later runtimes can load)"
        )
    warnings = []
    compat = str(target.get("hardware_compatibility", "none"))
    built_gpu = target.get("gpu", "?")
    if compat == "ampere_plus":
        if parse_version(compute_capability) < (8, 0):
            problems.append(
                f"it was built for Ampere and newer GPUs (compute capability >= 8.0); this "
                f"{gpu_name} has compute capability {compute_capability}"
            )
    elif built_cc != compute_capability:
        problems.append(
            f"it was built for compute capability {built_cc} ({built_gpu}); this {gpu_name} has "
            f"compute capability {compute_capability} (build with "
            "-O hardware_compatibility=ampere_plus for plans that load on any Ampere+ GPU)"
        )
    elif built_gpu != gpu_name:
        warnings.append(
            f"{path}: built on {built_gpu}, running on {gpu_name} (same compute capability "
            f"{compute_capability}): it loads, but its kernels were timed on the other GPU; "
            "rebuild here for best speed"
        )
    if problems:
        raise ArtifactError(
            f"{path}: this TensorRT engine cannot load here: {'; '.join(problems)}. Rebuild it "
            f"on this machine from its source model: {rebuild_command(manifest, path)}"
        )
    for w in warnings:
        log.warning(w)
    return warnings
