"""A content-addressed cache of built artifacts, safe to share between concurrent jobs.

Layout under the cache root::

    v1/entries/<k[:2]>/<key>.ekit    the artifact; its mtime is its last use (LRU)
    v1/entries/<k[:2]>/<key>.json    what it is (entry id, backend, precision, created)
    v1/locks/<key>.lock              fcntl lock: one builder per key, readers wait for it
    v1/tmp/                          files being written; renamed into place when whole

Writes go to ``tmp/`` and are renamed into place (atomic on one filesystem), so a reader sees
a whole artifact or none. A job takes the key's exclusive lock to look up, build and store, so
two jobs that need the same engine build it once: the second waits and gets a hit. ``prune``
removes least recently used entries whose lock it can take without waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from enginekit.errors import ArtifactError, EnginekitError
from enginekit.files import atomic_path, atomic_write, copy_atomic
from enginekit.version import __version__

LAYOUT = "v1"
_KEY = re.compile(r"[0-9a-f]{64}")
#: Files in tmp/ older than this are leftovers of a killed job.
STALE_TMP_S = 3600.0


def entry_key(build_key: str, extra: dict[str, Any] | None = None) -> str:
    """The cache key: the spine's build key (model bytes with external data, config, backend
    version, calibration, enginekit version, host) plus what else decides the artifact."""
    blob = json.dumps({"build_key": build_key, "cache": LAYOUT, **(extra or {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cached artifact."""

    key: str
    path: Path
    size: int
    last_used: float
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What ``prune`` removed and kept."""

    removed: tuple[CacheEntry, ...]
    kept: tuple[CacheEntry, ...]
    busy: tuple[str, ...]

    @property
    def freed(self) -> int:
        return sum(e.size for e in self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            "removed": [e.key for e in self.removed],
            "freed_bytes": self.freed,
            "kept": len(self.kept),
            "kept_bytes": sum(e.size for e in self.kept),
            "busy": list(self.busy),
        }


def _atomic_copy(src: Path, dest: Path, tmp_dir: Path | None = None) -> None:
    """Copy ``src`` to ``dest`` whole or not at all (temp file, fsync, rename), readable as a
    plain copy would be (the umask decides, not the temp file's private mode)."""
    del tmp_dir  # the temporary lives beside dest: same filesystem, so the rename is atomic
    copy_atomic(src, dest)


def _atomic_write_text(dest: Path, text: str, tmp_dir: Path) -> None:
    del tmp_dir
    with atomic_write(dest, "w") as f:
        f.write(text)


class _Corrupt(Exception):
    """A cached artifact failed its checksums (internal: ends :meth:`Cache.fetch` as a miss)."""


class Cache:
    """The artifact cache rooted at ``root`` (created on first use)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.base = self.root / LAYOUT
        self.entries_dir = self.base / "entries"
        self.locks_dir = self.base / "locks"
        self.tmp_dir = self.base / "tmp"
        #: keys whose cached artifact failed its checksums in :meth:`fetch` (evicted, a miss)
        self.evicted: list[str] = []

    def _ensure(self) -> None:
        for d in (self.entries_dir, self.locks_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """Where the artifact of ``key`` lives (whether or not it is there)."""
        if not _KEY.fullmatch(key):
            raise EnginekitError(f"cache key {key!r}: expected 64 hex digits (a SHA-256)")
        return self.entries_dir / key[:2] / f"{key}.ekit"

    @contextlib.contextmanager
    def lock(self, key: str, wait: bool = True) -> Iterator[bool]:
        """Hold the key's exclusive lock; with ``wait=False`` yields False if it is taken."""
        self._ensure()
        fd = os.open(self.locks_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    yield False
                    return
                raise
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def fetch(self, key: str, dest: Path) -> dict[str, Any] | None:
        """Copy the artifact of ``key`` to ``dest`` (atomically) and return its manifest; None
        on a miss. A cached artifact that fails its checksums is evicted and counts as a miss.

        Call with the key's lock held.
        """
        from enginekit.artifact import open_artifact

        src = self.path(key)
        if not src.is_file():
            return None
        try:
            with atomic_path(dest) as tmp:
                with open(tmp, "wb") as out, open(src, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
                    out.flush()
                    os.fsync(out.fileno())
                try:
                    manifest = open_artifact(tmp).manifest
                except ArtifactError:
                    self._evict(key)
                    self.evicted.append(key)
                    raise _Corrupt from None
        except _Corrupt:
            return None
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            os.utime(src, (now, now))
        return manifest

    def store(self, key: str, artifact: Path, meta: dict[str, Any] | None = None) -> Path:
        """Put a built artifact in the cache under ``key``. Call with the key's lock held."""
        self._ensure()
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        _atomic_copy(artifact, dest, self.tmp_dir)
        info = {
            "key": key,
            "created": time.time(),
            "enginekit_version": __version__,
            "size": dest.stat().st_size,
            **(meta or {}),
        }
        _atomic_write_text(dest.with_suffix(".json"), json.dumps(info, indent=1), self.tmp_dir)
        return dest

    def load_bench(self, key: str, signature: str) -> dict[str, Any] | None:
        """The bench result stored for ``key`` under the same ``signature`` (settings, host,
        enginekit version), or None."""
        with contextlib.suppress(FileNotFoundError, ValueError, OSError):
            data = json.loads(self.path(key).with_suffix(".bench.json").read_text("utf-8"))
            if data.get("signature") == signature and isinstance(data.get("result"), dict):
                return dict(data["result"])
        return None

    def store_bench(self, key: str, signature: str, result: dict[str, Any]) -> None:
        """Keep ``result`` beside the artifact of ``key`` for the next run on this host."""
        dest = self.path(key)
        if dest.is_file():
            text = json.dumps({"signature": signature, "result": result}, indent=1)
            _atomic_write_text(dest.with_suffix(".bench.json"), text, self.tmp_dir)

    def _evict(self, key: str) -> None:
        path = self.path(key)
        for p in (path, path.with_suffix(".json"), path.with_suffix(".bench.json")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def entries(self) -> list[CacheEntry]:
        """Every cached artifact, least recently used first."""
        found = []
        if not self.entries_dir.is_dir():
            return []
        for path in self.entries_dir.glob("*/*.ekit"):
            try:
                st = path.stat()
            except FileNotFoundError:  # pruned meanwhile
                continue
            meta: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
            found.append(CacheEntry(path.stem, path, st.st_size, st.st_mtime, meta))
        return sorted(found, key=lambda e: (e.last_used, e.key))

    def size(self) -> int:
        """Bytes held by cached artifacts."""
        return sum(e.size for e in self.entries())

    def prune(
        self,
        max_size: int | None = None,
        max_age_s: float | None = None,
        dry_run: bool = False,
    ) -> PruneResult:
        """Remove least recently used entries until at most ``max_size`` bytes remain, and
        entries unused for longer than ``max_age_s``. Entries locked by a running job are kept.
        """
        entries = self.entries()
        total = sum(e.size for e in entries)
        now = time.time()
        removed: list[CacheEntry] = []
        busy: list[str] = []
        for e in entries:
            too_old = max_age_s is not None and now - e.last_used > max_age_s
            too_big = max_size is not None and total > max_size
            if not (too_old or too_big):
                continue
            if dry_run:
                removed.append(e)
                total -= e.size
                continue
            with self.lock(e.key, wait=False) as got:
                if not got:
                    busy.append(e.key)
                    continue
                self._evict(e.key)
            removed.append(e)
            total -= e.size
        if not dry_run:
            self._clean_tmp(now)
            self._clean_locks(now)
        gone = {e.key for e in removed}
        return PruneResult(
            tuple(removed), tuple(e for e in entries if e.key not in gone), tuple(busy)
        )

    def _clean_locks(self, now: float) -> None:
        """Remove lock files of keys no longer cached. A job that opened one just before it went
        may build that key beside another job: both store by atomic rename, so the cache stays
        whole (the work is done twice, that is all)."""
        if not self.locks_dir.is_dir():
            return
        for lock in self.locks_dir.glob("*.lock"):
            key = lock.stem
            with contextlib.suppress(FileNotFoundError, EnginekitError):
                if self.path(key).exists() or now - lock.stat().st_mtime < STALE_TMP_S:
                    continue
                with self.lock(key, wait=False) as got:
                    if got:
                        lock.unlink()

    def _clean_tmp(self, now: float) -> None:
        if not self.tmp_dir.is_dir():
            return
        for p in self.tmp_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``5GB`` (10^9), ``5GiB`` (2^30), ``500MB``, ``1.5G``, ``1024`` (bytes) -> bytes.

    Raises:
        EnginekitError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise EnginekitError(
            f"size {text!r}: expected a number with an optional unit (B, KB, MB, GB, TB or "
            "KiB, MiB, GiB, TiB), e.g. 5GB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s`` -> seconds.

    Raises:
        EnginekitError: not a duration.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not m:
        raise EnginekitError(f"age {text!r}: expected a number and s, m, h, d or w, e.g. 30d")
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
    return float(m.group(1)) * scale
