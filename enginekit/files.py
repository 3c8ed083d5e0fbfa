"""Files that appear whole or not at all: written beside their destination, then renamed onto it.

The temporary files and folders are created private (``mkstemp``/``mkdtemp`` give 0600/0700)
and get the mode a plain ``open()``/``mkdir()`` would have given them (0666/0777 less the umask)
just before they are renamed into place, so a Triton server or a CI job running as another user
reads what enginekit wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def umask() -> int:
    """The process's umask (read without changing it where the OS allows)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no way to read it without setting it elsewhere
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode ``os.mkdir`` gives a new folder: 0777 less the umask."""
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """A temporary path next to ``path`` to write; it replaces ``path`` when the block ends
    without an error and is removed when it raises (a crash leaves no half-written file).

    The file gets the mode a plain ``open()`` would give it (0666 less the umask).
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", suffix=suffix, dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", suffix: str = "") -> Iterator[IO[Any]]:
    """:func:`atomic_path` opened: ``with atomic_write(p, "w") as f: f.write(text)``."""
    encoding = None if "b" in mode else "utf-8"
    with atomic_path(path, suffix) as tmp:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder next to ``path`` to fill; it replaces ``path`` (a folder or nothing)
    when the block ends without an error and is removed when it raises.

    The folder gets the mode a plain ``mkdir`` would give it (0777 less the umask); what is
    written inside it with ``open()``/``mkdir()`` already honours the umask.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, dir_mode())
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_atomic(src: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy the file ``src`` to ``dest`` whole or not at all (flushed to disk before the rename)."""
    with atomic_write(dest) as out, open(src, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
    return Path(dest)
