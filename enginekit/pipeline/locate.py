"""Line numbers of TOML keys: ``tomllib`` gives none, so scan the text for them.

:func:`key_lines` maps every key path it can place to its 1-based line: ``("model", "source")``,
``("engine", 1, "precision")`` (the second ``[[engine]]`` table), ``("gates", "max_abs_error",
"int8")`` (a key inside an inline table). Values inside arrays are not placed: their path falls
back to the key that holds the array (:func:`line_of`). :class:`Collector` gathers the problems
found while reading a build file, each :class:`Located` at its line.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

Path = tuple[str | int, ...]

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def format_path(path: Path) -> str:
    """``engine[1].precision``; keys that are not bare words are quoted."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if _BARE.fullmatch(part) else '"' + part.replace('"', '\\"') + '"'
            out += ("." if out else "") + text
    return out or "(top level)"


def _read_key(text: str, i: int) -> tuple[list[str], int]:
    """Parse a (dotted, possibly quoted) key starting at ``text[i]``; return parts and the end."""
    parts: list[str] = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] in "\"'":
            quote = text[i]
            j = i + 1
            buf = []
            while j < n and text[j] != quote:
                if quote == '"' and text[j] == "\\" and j + 1 < n:
                    buf.append(text[j + 1])
                    j += 2
                    continue
                buf.append(text[j])
                j += 1
            parts.append("".join(buf))
            i = j + 1
        else:
            m = _BARE.match(text, i)
            if not m:
                return parts, i
            parts.append(m.group())
            i = m.end()
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == ".":
            i += 1
            continue
        return parts, i


class _Scanner:
    def __init__(self) -> None:
        self.lines: dict[Path, int] = {}
        self.prefix: Path = ()
        self.aot: dict[Path, int] = {}  # array-of-tables path (resolved) -> current index
        self.depth = 0  # open [ / { across lines (multi-line arrays)
        self.ml_string: str | None = None  # open multi-line string delimiter

    def resolve(self, parts: list[str]) -> Path:
        """A header's parts with the current index of every array of tables on the way."""
        path: Path = ()
        for part in parts:
            path = (*path, part)
            if path in self.aot:
                path = (*path, self.aot[path])
        return path

    def header(self, line: str, number: int) -> None:
        is_aot = line.startswith("[[")
        parts, _ = _read_key(line, 2 if is_aot else 1)
        if not parts:
            return
        if is_aot:
            parent = self.resolve(parts[:-1])
            base = (*parent, parts[-1])
            self.aot[base] = self.aot.get(base, -1) + 1
            # Tables nested under a previous element of this array start afresh.
            for key in [k for k in self.aot if len(k) > len(base) and k[: len(base)] == base]:
                del self.aot[key]
            self.prefix = (*base, self.aot[base])
        else:
            self.prefix = self.resolve(parts)
        self.lines.setdefault(self.prefix, number)

    def value(self, text: str, i: int, path: Path, number: int) -> None:
        """Scan a value: record keys of inline tables, track open brackets and strings."""
        stack: list[tuple[str, Path]] = []
        n = len(text)
        while i < n:
            c = text[i]
            if c == "#":
                return
            if c in "\"'":
                triple = text[i : i + 3]
                if triple in ('"""', "'''"):
                    end = text.find(triple, i + 3)
                    if end < 0:
                        self.ml_string = triple
                        return
                    i = end + 3
                    continue
                j = i + 1
                while j < n and text[j] != c:
                    j += 2 if (c == '"' and text[j] == "\\") else 1
                i = j + 1
                continue
            if c == "[":
                stack.append(("[", path))
                self.depth += 1
            elif c == "{":
                outer = stack[-1] if stack else None
                stack.append(("{", path if not outer or outer[0] == "{" else ()))
                self.depth += 1
                i = self._inline_key(text, i + 1, stack, number)
                continue
            elif c in "]}":
                if stack:
                    stack.pop()
                self.depth = max(0, self.depth - 1)
            elif c == "," and stack and stack[-1][0] == "{":
                i = self._inline_key(text, i + 1, stack, number)
                continue
            elif c == "=" and stack and stack[-1][0] == "{":
                pass
            i += 1

    def _inline_key(self, text: str, i: int, stack: list[tuple[str, Path]], number: int) -> int:
        """Read ``key =`` right after ``{`` or ``,`` inside an inline table."""
        parts, j = _read_key(text, i)
        if not parts or j >= len(text) or text[j] != "=":
            return i
        base = stack[-1][1]
        if base:  # () marks an inline table inside an array: not placed
            key = (*base, *parts)
            self.lines.setdefault(key, number)
            # A nested inline table under this key gets this key as its base.
            k = j + 1
            while k < len(text) and text[k] in " \t":
                k += 1
            if k < len(text) and text[k] == "{":
                stack.append(("{", key))
                self.depth += 1
                return self._inline_key(text, k + 1, stack, number)
        return j + 1

    def line(self, raw: str, number: int) -> None:
        if self.ml_string is not None:
            end = raw.find(self.ml_string)
            if end < 0:
                return
            rest = raw[end + 3 :]
            self.ml_string = None
            self.value(rest, 0, (), number)
            return
        if self.depth > 0:
            self.value(raw, 0, (), number)
            return
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            return
        if stripped.startswith("["):
            self.header(stripped, number)
            return
        parts, i = _read_key(raw, 0)
        if not parts or i >= len(raw) or raw[i] != "=":
            return
        path = (*self.prefix, *parts)
        self.lines.setdefault(path, number)
        self.value(raw, i + 1, path, number)


def key_lines(text: str) -> dict[Path, int]:
    """Map each key path found in TOML ``text`` to its 1-based line number."""
    scanner = _Scanner()
    for number, raw in enumerate(text.splitlines(), start=1):
        scanner.line(raw, number)
    return scanner.lines


def line_of(lines: Mapping[Path, int], path: Path) -> int | None:
    """The line of ``path``, or of its nearest ancestor that was placed; None if none was."""
    for end in range(len(path), 0, -1):
        found = lines.get(tuple(path[:end]))
        if found is not None:
            return found
    return None


@dataclasses.dataclass(frozen=True)
class Located:
    """An issue with its line in the file (None when the key could not be placed)."""

    path: Path
    line: int | None
    message: str

    def format(self, file: os.PathLike | str) -> str:
        where = f"{file}:{self.line}" if self.line else str(file)
        return f"{where}: {format_path(self.path)}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"key": format_path(self.path), "line": self.line, "message": self.message}


class Collector:
    """Gathers the problems found in a build file, each placed at its line."""

    def __init__(self, text: str) -> None:
        self.lines = key_lines(text)
        self.errors: list[Located] = []
        self.warnings: list[Located] = []

    def error(self, path: Path, message: str) -> None:
        self.errors.append(Located(path, line_of(self.lines, path), message))

    def warn(self, path: Path, message: str) -> None:
        self.warnings.append(Located(path, line_of(self.lines, path), message))
