"""The package's imports, walked with ``ast``: no cycle, and every import follows the layer rule
that docs/architecture.md states (its ``layers`` block is read here, so the two cannot drift).

Every import counts: at module level, inside functions (they run later) and under
``if TYPE_CHECKING:`` (they never run, but a type named across layers or round a cycle ties the
modules together just the same); messages mark the type-only ones.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "enginekit"
DOC = ROOT / "docs" / "architecture.md"


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    type_only: bool


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(known: dict[str, Path] | None = None) -> list[Import]:
    """Every import of one of the package's modules by another."""
    known = known or modules()
    root = next(iter(sorted(known, key=len)))
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        typed = _type_checking_lines(tree)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = here[: len(here) - node.level + 1]
                    base = ".".join([*prefix, *([node.module] if node.module else [])])
                # `from pkg import sub` imports the submodule pkg.sub when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]  # fmt: skip
            for t in targets:
                if t.split(".")[0] != root:
                    continue
                target = _resolve(t, known)
                if target and target != name:
                    found.append(Import(name, target, node.lineno, node.lineno in typed))
    return found


def cycles(edges: list[Import]) -> list[list[Import]]:
    """The import cycles (each as its imports, in order): the shortest through each module
    that is on one."""
    graph: dict[str, list[Import]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for e in graph.get(v, []):
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found: list[list[Import]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for group in groups:
        for start in sorted(group):  # the shortest cycle through each module, each told once
            cycle = _shortest_cycle(graph, group, start)
            key = frozenset((e.source, e.target) for e in cycle)
            if key not in seen:
                seen.add(key)
                found.append(cycle)
    return found


def _shortest_cycle(graph: dict[str, list[Import]], group: set[str], start: str) -> list[Import]:
    """Breadth-first from ``start`` back to it, inside its strongly connected group."""
    paths: dict[str, list[Import]] = {start: []}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for e in graph.get(v, []):
            if e.target == start:
                return [*paths[v], e]
            if e.target in group and e.target not in paths:
                paths[e.target] = [*paths[v], e]
                queue.append(e.target)
    raise AssertionError(f"{start} is in a strongly connected group but on no cycle")


def layers(doc: Path = DOC) -> list[list[str]]:
    """The ``layers`` block of docs/architecture.md, top layer first."""
    text = doc.read_text(encoding="utf-8")
    block = re.search(r"```text layers\n(.*?)```", text, re.S)
    assert block, f"{doc} has no ```text layers block"
    rows = []
    for line in block.group(1).splitlines():
        entries = line.split("#")[0].replace(",", " ").split()
        if entries:
            rows.append(entries)
    return rows


def layer_of(module: str, rows: list[list[str]]) -> tuple[int, str] | None:
    """(layer number, 0 = bottom, and the entry) of a module: the longest entry naming it or a
    package holding it; the package root's entry names only the root module itself."""
    best: tuple[int, str] | None = None
    for depth, row in enumerate(reversed(rows)):
        for entry in row:
            covers = module == entry or ("." in entry and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > len(best[1])):
                best = (depth, entry)
    return best


def _where(e: Import) -> str:
    return f"{modules()[e.source].relative_to(ROOT)}:{e.line}"


def test_no_import_cycle():
    found = [
        " -> ".join([c[0].source, *(e.target for e in c)])
        + " ("
        + ", ".join(
            f"{e.source} imports {e.target} at {_where(e)}"
            + (" [type only]" if e.type_only else "")
            for e in c
        )
        + ")"
        for c in cycles(imports())
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_every_module_has_a_layer():
    rows = layers()
    missing = [m for m in modules() if layer_of(m, rows) is None]
    assert not missing, (
        f"modules in no layer of {DOC.relative_to(ROOT)}: {', '.join(missing)}; add each to the "
        "layer it belongs to (the page says which is which)"
    )


def test_imports_follow_the_layers():
    rows = layers()
    wrong = []
    for e in imports():
        src, dst = layer_of(e.source, rows), layer_of(e.target, rows)
        if src is not None and dst is not None and dst[0] > src[0]:
            wrong.append(
                f"{e.source} (layer of {src[1]}) imports {e.target} (layer of {dst[1]}, "
                f"above it) at {_where(e)}" + (" [type only]" if e.type_only else "")
            )
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_layers_name_only_real_modules():
    known = modules()
    stale = [e for row in layers() for e in row if e not in known]
    assert not stale, f"docs/architecture.md's layers name modules that do not exist: {stale}"


def test_cycle_detection_names_the_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.a\nif TYPE_CHECKING:\n    from pkg import d\n"
    )
    (pkg / "d.py").write_text("from pkg import c\n")
    found = cycles(imports(modules(pkg)))
    assert sorted([(e.source, e.target) for e in c] for c in found) == [
        [("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.c"), ("pkg.c", "pkg.a")],
        [("pkg.c", "pkg.d"), ("pkg.d", "pkg.c")],
    ]


def test_layer_rule_sees_lazy_and_type_only_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n"
        "def f():\n    import pkg.high\n"
    )
    (pkg / "high.py").write_text("from pkg import low\n")
    found = {(e.source, e.target, e.type_only) for e in imports(modules(pkg))}
    assert found == {
        ("pkg.low", "pkg.high", True),
        ("pkg.low", "pkg.high", False),
        ("pkg.high", "pkg.low", False),
    }
    rows = [["pkg", "pkg.high"], ["pkg.low"]]
    assert layer_of("pkg.high", rows) == (1, "pkg.high")
    assert layer_of("pkg.low", rows) == (0, "pkg.low")
    assert layer_of("pkg.other", rows) is None  # the root entry names only the root


def test_import_enginekit_and_its_cli_stay_light():
    heavy = ["torch", "tensorflow", "tvm", "jax", "tensorrt", "onnxruntime", "matplotlib"]
    code = (
        "import sys, enginekit, enginekit.cli; enginekit.cli.parser(); "
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import enginekit imported {out.stdout.strip()}"


def test_the_lazy_api_resolves_and_build_stays_the_function():
    # enginekit imports its heavy layers on first use; importing the submodule enginekit.build
    # from anywhere must neither rebind ek.build to the module nor lose the "auto" strategy.
    code = (
        "import importlib, enginekit as ek; stages = importlib.import_module('enginekit.build'); "
        "assert callable(ek.build) and ek.build is stages.build, ek.build; "
        "assert callable(stages.STRATEGIES['auto']); "
        "assert all(getattr(ek, n) is not None for n in ek.__all__); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(
    "module",
    ["enginekit.evaluate.choose", "enginekit.evaluate.compare", "enginekit.evaluate.reference",
     "enginekit.pipeline.matrix", "enginekit.cli.build"],
)  # fmt: skip
def test_a_module_that_imports_build_imports_first_in_a_fresh_process(module):
    # Each imports enginekit.build; imported before anything else, the package binds
    # enginekit.build while the module is half initialized (this was a circular ImportError
    # for enginekit.evaluate.choose, the "auto" strategy's own module).
    code = (
        f"import {module}; import enginekit as ek; from enginekit.build import STRATEGIES; "
        "assert callable(ek.build) and 'auto' in STRATEGIES; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
