"""The build file (``enginekit.toml``): TOML -> validated :class:`PipelineConfig` whose matrix
entries are the same :class:`enginekit.BuildConfig` the Python API and ``enginekit build`` use.

One description (:data:`enginekit.pipeline.spec.SPEC`) drives the checks and the JSON Schema
(:func:`enginekit.pipeline.spec.json_schema`).
Every problem is reported with its key path and line (``enginekit.toml:12: engine[1].precision:
...``); :func:`load` collects all of them before raising :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib  # type: ignore[no-redef]

from enginekit.config import BuildConfig, ShapeProfile
from enginekit.errors import EnginekitError
from enginekit.pipeline.checks import check_backend, check_outputs, check_shapes, model_has_qdq
from enginekit.pipeline.fields import Issue
from enginekit.pipeline.locate import Collector, Located
from enginekit.pipeline.locate import Path as KeyPath
from enginekit.pipeline.source import find_module
from enginekit.pipeline.spec import ENTRY_POINT, SPEC


class ConfigError(EnginekitError):
    """The build file is invalid; ``issues`` holds every problem with its key path and line."""

    def __init__(self, path: Path, issues: list[Located]) -> None:
        self.path = path
        self.issues = issues
        lines = "\n".join(i.format(path) for i in issues)
        super().__init__(f"{path}: {len(issues)} problem(s):\n{lines}")


# -- the validated config ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the model comes from.

    Attributes:
        source: as written in the file.
        path: the ONNX file (None for an exporter entry).
        entry: ``pkg.module:function`` (None for an ONNX file).
        name: artifact name prefix.
        export_options: keyword options for enginekit.export.
        python_path: folders put first on sys.path to import the entry.
        outputs: build only the subgraph computing these tensors (empty: the model's outputs).
    """

    source: str
    path: Path | None
    entry: str | None
    name: str
    export_options: Mapping[str, Any]
    python_path: tuple[Path, ...]
    outputs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One matrix entry: one artifact ``<id>.ekit``."""

    id: str
    index: int
    backend: str
    precision: str
    layout: str | None
    variant: str | None
    config: BuildConfig

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "engine": self.index,
            "backend": self.backend,
            "precision": self.precision,
            "layout": self.layout,
            "variant": self.variant,
            "config": self.config.to_json(),
        }


@dataclasses.dataclass(frozen=True)
class CalibrationSpec:
    """int8 calibration: data files (resolved) or a table, and the method."""

    data: tuple[Path, ...]
    method: str
    table: Path | None
    verify_data: tuple[Path, ...]
    single_source: bool  # data is one folder or file that enginekit reads itself


@dataclasses.dataclass(frozen=True)
class Gates:
    """Limits: per precision (``"default"`` for the rest) and the throughput regression."""

    max_abs_error: Mapping[str, float] = dataclasses.field(default_factory=dict)
    min_top1_agreement: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_throughput_regression: float | None = None

    def limit(self, gate: str, precision: str) -> float | None:
        table: Mapping[str, float] = getattr(self, gate)
        return table.get(precision, table.get("default"))

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs_error": dict(self.max_abs_error),
            "min_top1_agreement": dict(self.min_top1_agreement),
            "max_throughput_regression": self.max_throughput_regression,
        }


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """How entries are benchmarked."""

    enabled: bool = True
    batch_sizes: tuple[int, ...] | None = None
    duration: float = 0.5
    rounds: int = 3
    warmup: float = 0.1


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A validated build file."""

    path: Path
    sha256: str
    model: ModelSpec
    profiles: tuple[dict[str, ShapeProfile], ...]
    entries: tuple[Entry, ...]
    calibration: CalibrationSpec | None
    gates: Gates
    bench: BenchSpec
    warnings: tuple[Located, ...] = ()

    @property
    def root(self) -> Path:
        """The folder relative paths in the file are resolved against."""
        return self.path.parent


# -- loading -------------------------------------------------------------------------------------


def load(path: str | os.PathLike, strict: bool = False) -> PipelineConfig:
    """Read and validate a build file.

    Args:
        path: the TOML file.
        strict: treat warnings (an unregistered backend, a gate no entry uses) as errors.

    Raises:
        ConfigError: every problem, each with its key path and line.
    """
    file = Path(path)
    try:
        raw_bytes = file.read_bytes()
    except OSError as exc:
        raise ConfigError(file, [Located((), None, f"cannot read the build file: {exc}")]) from None
    text = raw_bytes.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _decode_error_line(str(exc))
        raise ConfigError(file, [Located((), line, f"not valid TOML: {exc}")]) from None
    c = Collector(text)
    issues: list[Issue] = []
    checked = SPEC.check(data, (), issues)
    for issue in issues:
        c.error(issue.path, issue.message)
    cfg = _build(file, hashlib.sha256(raw_bytes).hexdigest(), checked or {}, c)
    if strict:
        c.errors.extend(c.warnings)
        c.warnings = []
    if c.errors or cfg is None:
        raise ConfigError(file, sorted(c.errors, key=lambda i: (i.line or 0, i.path.__repr__())))
    return dataclasses.replace(cfg, warnings=tuple(c.warnings))


def _decode_error_line(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else None


def _build(file: Path, digest: str, data: dict[str, Any], c: Collector) -> PipelineConfig | None:
    root = file.parent
    model = _model(root, data.get("model"), c)
    profiles = _profiles(data.get("shapes"), c)
    calibration = _calibration(root, data.get("calibration"), c)
    if model is not None and model.path is not None:
        check_shapes(model.path, profiles, c)
        check_outputs(model.path, model.outputs, c)
    entries = _entries(data.get("engine") or [], profiles, calibration, model, c)
    gates = _gates(data.get("gates") or {}, entries, c)
    bench = _bench(data.get("bench") or {})
    if model is None or c.errors:
        return None
    return PipelineConfig(file, digest, model, profiles, entries, calibration, gates, bench)


def _model(root: Path, table: dict[str, Any] | None, c: Collector) -> ModelSpec | None:
    if not table or table.get("source") is None:
        return None
    source = table["source"]
    export = dict(table.get("export") or {})
    python_path = tuple(root / p for p in (table.get("python_path") or ["."]))
    outputs = tuple(table.get("outputs") or ())
    candidate = root / source
    if ENTRY_POINT.fullmatch(source) and not candidate.exists():
        module = source.partition(":")[0]
        problem = find_module(module, python_path)
        if problem:
            c.error(("model", "source"), problem)
        name = table.get("name") or module.rpartition(".")[2]
        return ModelSpec(source, None, source, name, export, python_path, outputs)
    if not candidate.is_file():
        what = "is a folder, not an ONNX file" if candidate.is_dir() else "does not exist"
        c.error(
            ("model", "source"),
            f"{candidate} {what}; give an ONNX file relative to {root} or an exporter entry "
            "'pkg.module:make_model'",
        )
        return None
    if export:
        c.warn(("model", "export"), "export options apply to exporter entries only; ignored")
    name = table.get("name") or candidate.stem
    path = Path(os.path.normpath(candidate))
    return ModelSpec(source, path, None, name, {}, python_path, outputs)


def _profiles(value: Any, c: Collector) -> tuple[dict[str, ShapeProfile], ...]:
    """The profiles, without the inputs whose shapes were invalid (already reported)."""
    if value is None:
        return ()
    profiles = tuple({k: v for k, v in (p or {}).items() if v is not None} for p in value)
    first = set(profiles[0]) if profiles else set()
    for i, p in enumerate(value[1:], start=1):
        if p is not None and set(p) != set(value[0] or ()):
            c.error(
                ("shapes", i),
                f"profile {i} covers inputs {sorted(p)}, profile 0 covers {sorted(first)}; every "
                "profile must cover the same inputs",
            )
    return profiles


def _files(root: Path, patterns: list[str], key: KeyPath, c: Collector) -> tuple[Path, ...]:
    found: list[Path] = []
    for i, pattern in enumerate(patterns):
        where = (*key, i) if len(patterns) > 1 else key
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(str(root / pattern), recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                c.error(where, f"{pattern!r} matches no file (looked relative to {root})")
            found.extend(matches)
        elif (root / pattern).exists():
            found.append(Path(os.path.normpath(root / pattern)))
        else:
            c.error(where, f"{root / pattern} does not exist")
    return tuple(found)


def _calibration(root: Path, table: dict[str, Any] | None, c: Collector) -> CalibrationSpec | None:
    if table is None:
        return None
    key = ("calibration",)
    data_patterns = table.get("data") or []
    data = _files(root, data_patterns, (*key, "data"), c) if data_patterns else ()
    table_path = None
    if table.get("table"):
        table_path = root / table["table"]
        if not table_path.is_file():
            c.error((*key, "table"), f"{table_path} does not exist")
    if data_patterns and table.get("table"):
        c.error(key, "give data (to calibrate) or table (already calibrated), not both")
    if not data_patterns and not table.get("table"):
        c.error(key, "give data = <.npy/.npz files, folders or globs> or table = <calib.json>")
    verify = table.get("verify_data") or []
    verify_files = _files(root, verify, (*key, "verify_data"), c) if verify else ()
    single = len(data_patterns) == 1 and not glob.has_magic(data_patterns[0])
    return CalibrationSpec(data, table.get("method") or "entropy", table_path, verify_files, single)


def _entries(
    tables: list[dict[str, Any] | None],
    profiles: tuple[dict[str, ShapeProfile], ...],
    calibration: CalibrationSpec | None,
    model: ModelSpec | None,
    c: Collector,
) -> tuple[Entry, ...]:
    name = model.name if model is not None else "model"

    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for index, t in enumerate(tables):
        key: KeyPath = ("engine", index)
        if not t or t.get("backend") is None or t.get("precision", ["fp32"]) is None:
            continue
        backend = t["backend"]
        precisions = t.get("precision") or ["fp32"]
        layouts = t.get("layout") or [None]
        options = dict(t.get("options") or {})
        if "layout" in options and t.get("layout"):
            c.error((*key, "layout"), "layout is given twice (here and in options); keep one")
        check_backend(backend, precisions, t.get("layout") is not None, options, key, c)
        if "int8" in precisions and calibration is None:
            if model is None or model.path is None or not model_has_qdq(model.path):
                c.error(
                    (*key, "precision"),
                    "int8 needs a [calibration] section (data or table); only a model with "
                    "Q/DQ nodes needs none",
                )
        for precision in precisions:
            for layout in layouts:
                parts = [name, backend]
                if t.get("variant"):
                    parts.append(t["variant"])
                parts.append(precision)
                if layout is not None and len(layouts) > 1:
                    parts.append(layout.lower())
                entry_id = "-".join(parts)
                entry_options = {**options, **({"layout": layout} if layout else {})}
                try:
                    config = BuildConfig(
                        backend=backend,
                        profiles=profiles,
                        precision=precision,
                        device=t.get("device") or "cpu",
                        verify=t.get("verify", True),
                        atol=t.get("atol"),
                        rtol=t.get("rtol"),
                        seed=t.get("seed") or 0,
                        rule=t.get("rule") or "scaled",
                        min_cosine=t.get("min_cosine"),
                        options=entry_options,
                        simplify=t.get("simplify", True),
                        outputs=model.outputs if model is not None else (),
                    )
                except EnginekitError as exc:
                    c.error((*key, "device"), str(exc))
                    continue
                if entry_id in seen:
                    c.error(
                        key,
                        f"entry {entry_id!r} is also made by engine[{seen[entry_id]}]; give "
                        'one of them variant = "..." to tell their artifacts apart',
                    )
                    continue
                seen[entry_id] = index
                entries.append(
                    Entry(entry_id, index, backend, precision, layout, t.get("variant"), config)
                )
    return tuple(entries)


def _gates(table: dict[str, Any], entries: tuple[Entry, ...], c: Collector) -> Gates:
    used = {e.precision for e in entries}
    for gate in ("max_abs_error", "min_top1_agreement"):
        for precision in table.get(gate) or {}:
            if precision != "default" and entries and precision not in used:
                c.warn(
                    ("gates", gate, precision),
                    f"no entry builds {precision}; this limit applies to nothing",
                )
    return Gates(
        max_abs_error=dict(table.get("max_abs_error") or {}),
        min_top1_agreement=dict(table.get("min_top1_agreement") or {}),
        max_throughput_regression=table.get("max_throughput_regression"),
    )


def _bench(table: dict[str, Any]) -> BenchSpec:
    sizes = table.get("batch_sizes")
    return BenchSpec(
        enabled=table.get("enabled", True),
        batch_sizes=tuple(sizes) if sizes else None,
        duration=float(table.get("duration") or 0.5),
        rounds=int(table.get("rounds") or 3),
        warmup=float(table["warmup"]) if table.get("warmup") is not None else 0.1,
    )
