"""A small declarative type system for the build file: one description of every key drives both
the validation (types, unknown keys with did-you-mean, ranges) and the JSON Schema for editors.

Each node's ``check(value, path, issues)`` appends an :class:`Issue` for what is wrong and
returns the value (or None when it cannot be used); ``schema()`` returns its JSON Schema.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from enginekit.errors import did_you_mean
from enginekit.pipeline.locate import Path


@dataclasses.dataclass(frozen=True)
class Issue:
    """One problem in the build file: where (key path) and what."""

    path: Path
    message: str


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


class Node:
    """A value description; subclasses check one kind of value."""

    doc: str = ""

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def _base(self) -> dict[str, Any]:
        return {"description": self.doc} if self.doc else {}


class Str(Node):
    """A string, optionally one of ``choices`` or matching ``pattern``."""

    def __init__(
        self,
        doc: str = "",
        choices: Sequence[str] | None = None,
        pattern: str | None = None,
        hint: str = "",
    ) -> None:
        self.doc, self.choices, self.pattern, self.hint = doc, choices, pattern, hint

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, str):
            issues.append(Issue(path, f"expected a string, got {_kind(value)}"))
            return None
        if self.choices is not None and value not in self.choices:
            hint = did_you_mean(value, self.choices)
            issues.append(Issue(path, f"{value!r} is not one of {', '.join(self.choices)}{hint}"))
            return None
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            issues.append(
                Issue(path, f"{value!r} is not valid{': ' + self.hint if self.hint else ''}")
            )
            return None
        return value

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "string", **self._base()}
        if self.choices is not None:
            out["enum"] = list(self.choices)
        if self.pattern is not None:
            out["pattern"] = f"^(?:{self.pattern})$"
        return out


class Num(Node):
    """A number (integers too) in ``[minimum, maximum]``; ``integer`` for whole numbers only."""

    def __init__(
        self,
        doc: str = "",
        minimum: float | None = None,
        maximum: float | None = None,
        integer: bool = False,
        exclusive_minimum: bool = False,
    ) -> None:
        self.doc, self.minimum, self.maximum = doc, minimum, maximum
        self.integer, self.exclusive_minimum = integer, exclusive_minimum

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        ok = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            what = "an integer" if self.integer else "a number"
            issues.append(Issue(path, f"expected {what}, got {_kind(value)}"))
            return None
        lo, hi = self.minimum, self.maximum
        if lo is not None and (value <= lo if self.exclusive_minimum else value < lo):
            issues.append(
                Issue(path, f"{value} must be {'>' if self.exclusive_minimum else '>='} {lo}")
            )
            return None
        if hi is not None and value > hi:
            issues.append(Issue(path, f"{value} must be <= {hi}"))
            return None
        return value

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer" if self.integer else "number", **self._base()}
        if self.minimum is not None:
            out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


class Bool(Node):
    """true or false."""

    def __init__(self, doc: str = "") -> None:
        self.doc = doc

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, bool):
            issues.append(Issue(path, f"expected true or false, got {_kind(value)}"))
            return None
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean", **self._base()}


class ListOf(Node):
    """An array whose items are all ``item``."""

    def __init__(self, item: Node, doc: str = "", min_items: int = 0) -> None:
        self.item, self.doc, self.min_items = item, doc, min_items

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, list):
            issues.append(Issue(path, f"expected an array, got {_kind(value)}"))
            return None
        if len(value) < self.min_items:
            issues.append(Issue(path, f"expected at least {self.min_items} item(s), got none"))
            return None
        out = [self.item.check(v, (*path, i), issues) for i, v in enumerate(value)]
        return None if any(v is None for v in out) else out

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "array", "items": self.item.schema(), **self._base()}
        if self.min_items:
            out["minItems"] = self.min_items
        return out


class OneOrList(Node):
    """One ``item`` or a non-empty array of them; checks to a list."""

    def __init__(self, item: Node, doc: str = "") -> None:
        self.item, self.doc = item, doc

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if isinstance(value, list):
            return ListOf(self.item, min_items=1).check(value, path, issues)
        checked = self.item.check(value, path, issues)
        return None if checked is None else [checked]

    def schema(self) -> dict[str, Any]:
        item = self.item.schema()
        return {
            **self._base(),
            "anyOf": [item, {"type": "array", "items": item, "minItems": 1}],
        }


class AnyOf(Node):
    """The first alternative that accepts the value; else the message names what fits."""

    def __init__(self, *alternatives: Node, doc: str = "", expected: str = "") -> None:
        self.alternatives, self.doc, self.expected = alternatives, doc, expected

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        for alt in self.alternatives:
            trial: list[Issue] = []
            out = alt.check(value, path, trial)
            if not trial:
                return out
        issues.append(Issue(path, f"expected {self.expected}, got {_kind(value)}"))
        return None

    def schema(self) -> dict[str, Any]:
        return {**self._base(), "anyOf": [a.schema() for a in self.alternatives]}


@dataclasses.dataclass(frozen=True)
class Key:
    """A key of a table: its value description, whether required, its default (for docs)."""

    node: Node
    required: bool = False
    default: Any = None


class Table(Node):
    """A table with known ``keys`` (unknown ones are errors with a did-you-mean), or, with
    ``values``, a table of any keys whose values are all ``values``."""

    def __init__(
        self,
        keys: Mapping[str, Key] | None = None,
        doc: str = "",
        values: Node | None = None,
        key_names: Sequence[str] | None = None,
    ) -> None:
        self.keys = dict(keys or {})
        self.doc, self.values, self.key_names = doc, values, key_names

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, dict):
            issues.append(Issue(path, f"expected a table, got {_kind(value)}"))
            return None
        out: dict[str, Any] = {}
        for name, item in value.items():
            if self.values is not None:
                if self.key_names is not None and name not in self.key_names:
                    hint = did_you_mean(name, self.key_names)
                    issues.append(
                        Issue(
                            (*path, name),
                            f"unknown key{hint} (expected one of {', '.join(self.key_names)})",
                        )
                    )
                    continue
                out[name] = self.values.check(item, (*path, name), issues)
            elif name in self.keys:
                out[name] = self.keys[name].node.check(item, (*path, name), issues)
            else:
                hint = did_you_mean(name, list(self.keys))
                known = ", ".join(self.keys) or "none"
                issues.append(Issue((*path, name), f"unknown key{hint} (known keys: {known})"))
        for name, key in self.keys.items():
            if key.required and name not in value:
                issues.append(Issue(path, f"missing required key {name!r}"))
        return out

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object", **self._base()}
        if self.values is not None:
            if self.key_names is not None:
                out["propertyNames"] = {"enum": list(self.key_names)}
            out["additionalProperties"] = self.values.schema()
            return out
        props = {}
        for name, key in self.keys.items():
            prop = key.node.schema()
            if key.default is not None:
                prop["default"] = key.default
            props[name] = prop
        out["properties"] = props
        out["additionalProperties"] = False
        required = [n for n, k in self.keys.items() if k.required]
        if required:
            out["required"] = required
        return out


class OpenTable(Node):
    """A table of free-form keys and values (passed through, e.g. backend options)."""

    def __init__(self, doc: str = "") -> None:
        self.doc = doc

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, dict):
            issues.append(Issue(path, f"expected a table, got {_kind(value)}"))
            return None
        return dict(value)

    def schema(self) -> dict[str, Any]:
        return {"type": "object", **self._base()}


class ArrayOfTables(Node):
    """``[[name]]`` tables, each checked against ``table``."""

    def __init__(self, table: Table, doc: str = "", min_items: int = 1) -> None:
        self.table, self.doc, self.min_items = table, doc, min_items

    def check(self, value: Any, path: Path, issues: list[Issue]) -> Any:
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            issues.append(Issue(path, f"expected [[{path[-1]}]] tables, got {_kind(value)}"))
            return None
        if len(value) < self.min_items:
            issues.append(Issue(path, f"expected at least {self.min_items} [[{path[-1]}]] table"))
            return None
        return [self.table.check(v, (*path, i), issues) for i, v in enumerate(value)]

    def schema(self) -> dict[str, Any]:
        out = {"type": "array", "items": self.table.schema(), **self._base()}
        if self.min_items:
            out["minItems"] = self.min_items
        return out
