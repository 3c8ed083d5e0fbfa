"""Files that appear whole or not at all: written beside their destination, then renamed onto it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """A temporary path next to ``path`` to write; it replaces ``path`` when the block ends
    without an error and is removed when it raises (a crash leaves no half-written file)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", suffix=suffix, dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", suffix: str = "") -> Iterator[IO[Any]]:
    """:func:`atomic_path` opened: ``with atomic_write(p, "w") as f: f.write(text)``."""
    encoding = None if "b" in mode else "utf-8"
    with atomic_path(path, suffix) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f
