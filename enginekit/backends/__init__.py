"""Backend registry and contract.

A backend is a module (or any object) with:

- ``NAME: str`` and ``OPTIONS: dict[str, str]`` (backend option -> one-line help);
- ``available() -> Availability``: installed? which version, which devices, why not;
- ``build(model, config, workdir) -> BuildResult``: writes payload files into ``workdir``;
- ``load(artifact, device) -> Engine``: fast, no compilation;
- optionally ``supported_ops() -> list[str]`` and ``inspect(artifact) -> dict``;
- optionally ``PRECISIONS`` (what it builds; default fp32) and ``DEVICE_PRECISIONS``
  (``{"cpu": ("fp32", "int8")}``: fewer on some device kinds);
- optionally ``PACKAGES``: the distributions its heavy dependency comes in (the first gives
  the version). ``enginekit backends`` then answers from their metadata without importing them
  (:func:`quick_availability`); ``--check`` imports and probes.

:func:`load` opens an artifact with the backend its manifest names: ``enginekit.load``.

Built-in backends are listed in ``_BUILTIN``; third parties register more through the
``enginekit.backends`` entry-point group (``name = "package.module"``). Modules are imported on
first use, and import their heavy dependency lazily, so ``import enginekit`` stays light.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from enginekit import target
from enginekit.artifact import Artifact, open_artifact, rebuild_command
from enginekit.errors import (
    ArtifactError,
    BackendUnavailable,
    BuildError,
    UnknownBackend,
    UsageError,
    did_you_mean,
)
from enginekit.quiet import native_stderr

if TYPE_CHECKING:
    from enginekit.config import BuildConfig
    from enginekit.engine import Engine
    from enginekit.model import Model

_BUILTIN: dict[str, str] = {
    "onnxruntime": "enginekit.backends.onnxruntime",
    "tensorrt": "enginekit.backends.tensorrt",
    "xla": "enginekit.backends.xla",
    "tvm": "enginekit.backends.tvm",
    "openvino": "enginekit.backends.openvino",
}


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether a backend can build and run here, and if not, why and what to do."""

    name: str
    available: bool
    version: str | None = None
    devices: tuple[str, ...] = ()
    reason: str = ""
    probed: bool = True  # False: from package metadata, nothing imported (devices unknown)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "version": self.version,
            "devices": list(self.devices),
            "reason": self.reason,
            "probed": self.probed,
        }


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What a backend's build wrote.

    Attributes:
        files: payload file names, relative to the build's workdir.
        metadata: backend facts for the manifest (optimization level, layout, tuning time, ...).
        target: what the payload needs from the host: ``{"kind": "cpu", "requires": [isa flags]}``
            or ``{"kind": "cuda", "compute_capability": "9.0"}``; ``load`` checks it.
    """

    files: tuple[str, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    target: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Backend(Protocol):
    """The contract every backend module fulfils."""

    NAME: str
    OPTIONS: Mapping[str, str]

    def available(self) -> Availability: ...

    def build(self, model: Model, config: BuildConfig, workdir: Path) -> BuildResult: ...

    def load(self, artifact: Artifact, device: str) -> Engine: ...


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="enginekit.backends")}


def names() -> list[str]:
    """Every registered backend name, built-in first."""
    extra = [n for n in _entry_points() if n not in _BUILTIN]
    return list(_BUILTIN) + sorted(extra)


_loaded: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """The backend registered as ``name`` (imports its module, not its heavy dependency).

    Raises:
        UnknownBackend: no backend of that name is registered (a usage error, with the closest
            registered name).
    """
    if name in _loaded:
        return _loaded[name]
    if name in _BUILTIN:
        backend: Any = importlib.import_module(_BUILTIN[name])
    else:
        eps = _entry_points()
        if name not in eps:
            check_name(name)
        backend = eps[name].load()
        if isinstance(backend, str):
            backend = importlib.import_module(backend)
    _loaded[name] = backend
    return backend


def check_name(name: str) -> None:
    """Refuse a name no backend is registered under, suggesting the closest one.

    Raises:
        UnknownBackend: ``name`` is not registered (a typo or a plugin not installed).
    """
    registered = names()
    if name not in registered:
        raise UnknownBackend(
            f"no backend named {name!r}{did_you_mean(name, registered)} (registered: "
            f"{', '.join(registered)}; `enginekit backends` lists them)"
        )


def availability(name: str) -> Availability:
    """Availability of one backend; never raises for a registered name."""
    try:
        return get(name).available()
    except BackendUnavailable:
        raise
    except Exception as exc:  # a broken install must not break `enginekit backends`
        return Availability(name, False, reason=f"{type(exc).__name__}: {exc}")


def quick_availability(name: str) -> Availability:
    """Availability without importing the framework, where the backend names its ``PACKAGES``
    and they are all installed (devices unknown: ``probed`` is False); else :func:`availability`."""
    packages = tuple(getattr(get(name), "PACKAGES", ()))
    if not packages:
        return availability(name)
    versions = []
    for dist in packages:
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            return availability(name)  # missing: the backend's own reason (fast: nothing to load)
    return Availability(
        name,
        True,
        versions[0],
        reason="installed (not imported; `enginekit backends --check` probes its devices)",
        probed=False,
    )


def precisions(backend: Backend, device: str = "cpu") -> tuple[str, ...]:
    """The precisions ``backend`` builds for ``device`` (its ``DEVICE_PRECISIONS`` entry for
    the device kind, else its ``PRECISIONS``, else fp32)."""
    listed = tuple(getattr(backend, "PRECISIONS", ("fp32",)))
    by_device = getattr(backend, "DEVICE_PRECISIONS", {})
    return tuple(by_device.get(device.split(":")[0], listed))


def require(name: str, device: str = "cpu") -> Backend:
    """The backend ``name``, checked to be installed and to have ``device``.

    Raises:
        BackendUnavailable: not installed, or no such device here; says what to install.
    """
    backend = get(name)
    avail = availability(name)
    if not avail.available:
        raise BackendUnavailable(f"backend {name!r} is not available here: {avail.reason}")
    kind = device.split(":")[0]
    if not any(d.split(":")[0] == kind for d in avail.devices):
        raise BackendUnavailable(
            f"backend {name!r} has no {device!r} device here (it has: "
            f"{', '.join(avail.devices) or 'none'})"
        )
    return backend


def check_options(backend: Backend, options: Mapping[str, Any]) -> None:
    """Refuse options the backend does not know, listing the ones it does."""
    known = getattr(backend, "OPTIONS", {})
    unknown = [k for k in options if k not in known]
    if unknown:
        listing = ", ".join(sorted(known)) or "none"
        hints = "".join(did_you_mean(k, known) for k in unknown)
        raise BuildError(
            f"backend {backend.NAME!r} has no option(s) {', '.join(map(repr, unknown))}{hints} "
            f"(its options: {listing})"
        )


#: Options ``load`` takes: name -> what it sets. A backend lists those it honours in its own
#: ``LOAD_OPTIONS`` (a subset of these); the artifact's build options are the default.
LOAD_OPTIONS = {
    "threads": "threads one engine call uses (an integer >= 1; 0: the backend's default)",
    "spinning": "idle threads spin waiting for work (true: lowest latency) or sleep (false: "
    "leaves the cores to other work, e.g. a dataset job's reader and writer)",
}


def check_load_options(backend: Backend, options: Mapping[str, Any]) -> dict[str, Any]:
    """The load options that are set (not None), checked against what ``backend`` honours.

    Raises:
        UsageError: an option this backend cannot set at load, or a value of the wrong kind.
    """
    given = {k: v for k, v in options.items() if v is not None}
    known = getattr(backend, "LOAD_OPTIONS", {})
    for name, value in given.items():
        if name not in known:
            honoured = ", ".join(sorted(known)) or "none"
            raise UsageError(
                f"backend {backend.NAME!r} cannot set {name!r} at load (its load options: "
                f"{honoured}); set it at build time instead (`enginekit build --help` lists the "
                "backend's options), or drop it"
            )
        if name == "threads" and not (isinstance(value, int) and not isinstance(value, bool)
                                      and value >= 0):  # fmt: skip
            raise UsageError(f"threads must be an integer >= 0 (0: default), got {value!r}")
        if name == "spinning" and not isinstance(value, bool):
            raise UsageError(f"spinning must be true or false, got {value!r}")
    return given


def load(
    path: str | os.PathLike,
    device: str | None = None,
    *,
    threads: int | None = None,
    spinning: bool | None = None,
) -> Engine:
    """Load an engine artifact (``.ekit`` file or directory) and return its Engine.

    Checks the format version, every payload checksum, that the backend is installed, and that
    this host can run the artifact's target; no compilation happens here.

    Args:
        device: run on this device instead of the artifact's own.
        threads: threads one engine call uses, instead of the artifact's build option (None:
            the build's; see :data:`LOAD_OPTIONS`). The payload is the same: only the runtime's
            threading changes.
        spinning: whether idle engine threads spin (None: the build's).

    Raises:
        ArtifactError: what is wrong, and what to do (usually: rebuild from the source model).
        UsageError: a load option the artifact's backend cannot set (its valid ones named).
    """
    artifact = open_artifact(path)
    manifest = artifact.manifest
    name = manifest.get("backend", {}).get("name")
    device = device or manifest.get("config", {}).get("device", "cpu")
    try:
        be = require(str(name), str(device))
    except BackendUnavailable as exc:
        raise ArtifactError(f"{path}: cannot load a {name} engine here: {exc}") from None
    problems = target.missing_features(manifest.get("target", {}))
    if problems:
        raise ArtifactError(
            f"{path}: built for a host with {'; '.join(problems)}. Rebuild it on this host: "
            f"{rebuild_command(manifest, str(path))}"
        )
    overrides = check_load_options(be, {"threads": threads, "spinning": spinning})
    with native_stderr(f"loading {path} on {name}"):
        # Only backends that honour load options are passed any: the Backend contract's
        # ``load(artifact, device)`` stays valid for every plugin.
        engine = be.load(artifact, str(device), **overrides)
    engine.manifest = manifest
    engine.artifact = artifact
    engine.load_options = overrides
    return engine
