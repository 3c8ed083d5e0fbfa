"""Engine artifacts: a ``.ekit`` file (stored zip) or a directory, holding ``manifest.json`` and a
``payload/`` folder; written atomically, opened with every checksum verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginekit import target
from enginekit.errors import ArtifactError
from enginekit.files import atomic_dir, atomic_write
from enginekit.version import __version__

if TYPE_CHECKING:
    from enginekit.config import BuildConfig
    from enginekit.model import Model

#: Version of the artifact layout and manifest schema; bump on incompatible change.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PAYLOAD = "payload/"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def payload_entries(workdir: Path, files: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``manifest["payload"]``: SHA-256 and size of each payload file (relative to workdir)."""
    return {
        name: {"sha256": _sha256_file(workdir / name), "size": (workdir / name).stat().st_size}
        for name in files
    }


class Artifact:
    """An opened artifact whose manifest was read and whose payload checksums all matched.

    Attributes:
        path: the ``.ekit`` file or directory.
        manifest: the parsed manifest.json.
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._extracted: Path | None = None
        self._cleanup: weakref.finalize | None = None

    @property
    def is_dir(self) -> bool:
        return self.path.is_dir()

    @property
    def payload_names(self) -> list[str]:
        return list(self.manifest.get("payload", {}))

    def read(self, name: str) -> bytes:
        """The bytes of payload file ``name``, checked against the manifest's SHA-256."""
        expected = self._entry(name)["sha256"]
        try:
            if self.is_dir:
                data = (self.path / PAYLOAD / name).read_bytes()
            else:
                with zipfile.ZipFile(self.path) as z:
                    data = z.read(PAYLOAD + name)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise ArtifactError(f"{self.path}: cannot read payload {name!r}: {exc}") from None
        if hashlib.sha256(data).hexdigest() != expected:
            raise ArtifactError(
                f"{self.path}: payload {name!r} changed since it was built (checksum mismatch)"
            )
        return data

    def file(self, name: str) -> Path:
        """A path to payload file ``name`` on disk, checksum verified after extraction.

        Native code (a compiled ``.so``) is loaded only through this path, so only bytes whose
        checksum matches the manifest ever reach the loader.
        """
        entry = self._entry(name)
        if self.is_dir:
            path = self.path / PAYLOAD / name
        else:
            if self._extracted is None:
                self._extracted = Path(tempfile.mkdtemp(prefix="enginekit-"))
                self._cleanup = weakref.finalize(self, shutil.rmtree, self._extracted, True)
            path = self._extracted / name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(self.read(name))
                return path
        if _sha256_file(path) != entry["sha256"]:
            raise ArtifactError(
                f"{self.path}: payload {name!r} changed since it was built (checksum mismatch)"
            )
        return path

    def close(self) -> None:
        """Remove extracted files (also done when the Artifact is garbage collected)."""
        if self._cleanup is not None:
            self._cleanup()

    def _entry(self, name: str) -> Mapping[str, Any]:
        payload = self.manifest.get("payload", {})
        if name not in payload:
            raise ArtifactError(
                f"{self.path}: the manifest lists no payload {name!r} (it has {', '.join(payload) or 'none'})"
            )
        return payload[name]


def _read_manifest_text(path: Path) -> str:
    if path.is_dir():
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise ArtifactError(f"{path}: a directory without {MANIFEST} is not an engine artifact")
        return mpath.read_text(encoding="utf-8")
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            if bad is not None:
                raise ArtifactError(
                    f"{path}: member {bad!r} is corrupt (CRC mismatch); rebuild or re-download it"
                )
            return z.read(MANIFEST).decode("utf-8")
    except zipfile.BadZipFile as exc:
        raise ArtifactError(
            f"{path}: not a valid .ekit file, truncated or corrupt ({exc}); rebuild it"
        ) from None
    except KeyError:
        raise ArtifactError(
            f"{path}: the archive has no {MANIFEST}; not an engine artifact"
        ) from None


def open_artifact(path: str | os.PathLike) -> Artifact:
    """Open an artifact, check its format version and every payload checksum.

    Raises:
        ArtifactError: missing, truncated, corrupt, tampered with, or from a newer format.
    """
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such engine artifact")
    try:
        manifest = json.loads(_read_manifest_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise ArtifactError(f"{path}: {MANIFEST} has no format_version; not an engine artifact")
    version = manifest["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        made_by = manifest.get("enginekit_version", "?")
        raise ArtifactError(
            f"{path}: artifact format {version} was written by enginekit {made_by}; this enginekit "
            f"reads format <= {FORMAT_VERSION}. Upgrade enginekit or rebuild the engine with this one."
        )
    artifact = Artifact(path, manifest)
    for name in artifact.payload_names:
        if path.is_dir():
            artifact.file(name)
        else:
            artifact.read(name)
    return artifact


def write_artifact(
    path: str | os.PathLike,
    manifest: Mapping[str, Any],
    workdir: Path,
    files: list[str] | tuple[str, ...],
) -> Path:
    """Write ``manifest`` and the payload ``files`` (relative to ``workdir``) atomically.

    A path that ends with a separator or is an existing directory gets a directory artifact;
    anything else a ``.ekit`` file. Either way the result appears whole or not at all.

    Returns:
        the artifact path.
    """
    target = Path(path)
    as_dir = str(path).endswith(("/", os.sep)) or target.is_dir()
    manifest = dict(manifest)
    manifest["payload"] = payload_entries(workdir, files)
    text = json.dumps(manifest, indent=2, sort_keys=False)
    if as_dir:
        with atomic_dir(target) as tmp:
            for name in files:
                dest = tmp / PAYLOAD / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(workdir / name, dest)
            (tmp / MANIFEST).write_text(text, encoding="utf-8")
        return target
    with atomic_write(target) as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as z:
        z.writestr(MANIFEST, text)
        for name in files:
            z.write(workdir / name, PAYLOAD + name)
    return target


def rebuild_command(manifest: Mapping[str, Any], output: str | None = None) -> str:
    """The ``enginekit build`` command that rebuilds the same engine from its source model:
    backend, every profile's ``--shapes``, precision, device and ``-O`` options."""
    import shlex

    config = manifest.get("config", {})
    source = (manifest.get("source") or {}).get("path") or "<model.onnx>"
    parts = ["enginekit", "build", source, "--backend", str(config.get("backend", "onnxruntime"))]
    for profile in config.get("profiles", []):
        specs = [
            f"{name}:{','.join('x'.join(str(d) for d in s) for s in shapes)}"
            for name, shapes in profile.items()
        ]
        if specs:
            parts += ["--shapes", *specs]
    parts += ["--precision", str(config.get("precision", "fp32"))]
    if config.get("device", "cpu") != "cpu":
        parts += ["--device", str(config["device"])]
    for key, value in (config.get("options") or {}).items():
        parts += ["-O", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    parts += ["-o", output or "<engine.ekit>"]
    return " ".join(shlex.quote(p) for p in parts)


def build_key(
    model: Model, config: BuildConfig, backend_version: str | None, calibration: str | None = None
) -> str:
    """SHA-256 of everything that decides the build's output: same key, same engine."""
    blob = json.dumps(
        {
            "model": model.sha256,
            "config": config.to_json(),
            "backend_version": backend_version,
            "calibration": calibration,
            "enginekit": __version__,
            "host": {"machine": target.host()["machine"], "isa": target.host()["isa"]},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()
