"""The build file's description: every table and key with its type, default and help, as
:mod:`enginekit.pipeline.fields` nodes. It drives both the checks in
:mod:`enginekit.pipeline.config` and the JSON Schema for editors (:func:`json_schema`).
"""

from __future__ import annotations

import re
from typing import Any

from enginekit.config import Precision, normalize_shapes
from enginekit.errors import EnginekitError
from enginekit.pipeline.fields import (
    ArrayOfTables,
    Bool,
    Issue,
    Key,
    ListOf,
    Node,
    Num,
    OneOrList,
    OpenTable,
    Str,
    Table,
    _kind,
)
from enginekit.pipeline.locate import Path as KeyPath

PRECISIONS = tuple(p.value for p in Precision)
CALIBRATION_METHODS = ("entropy", "percentile", "minmax")
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
ENTRY_POINT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_ONE_SHAPE = r"(?:scalar|\d+(?:x\d+)*)"
SHAPE_PATTERN = rf"{_ONE_SHAPE}(?:,{_ONE_SHAPE},{_ONE_SHAPE})?"


# -- the spec ------------------------------------------------------------------------------------


class ShapeSpec(Node):
    """One input's shapes: ``"8x16"``, ``"1x16,8x16,64x16"``, ``["1x16", "8x16", "64x16"]``,
    ``[8, 16]`` or ``[[1, 16], [8, 16], [64, 16]]``; checks to a ShapeProfile through
    :func:`enginekit.config.normalize_shapes`."""

    doc = (
        "shapes of one input: one shape (fixed) or three (min, opt, max); as text 'AxB' / "
        "'AxB,CxD,ExF', an array of shape strings, an array of dims, or three arrays of dims"
    )

    def check(self, value: Any, path: KeyPath, issues: list[Issue]) -> Any:
        name = str(path[-1])
        arg: Any = value
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) not in (1, 3):
                issues.append(
                    Issue(path, f"give one shape or three (min, opt, max), got {len(value)}")
                )
                return None
            arg = ",".join(value)
        elif not isinstance(value, (str, list)):
            issues.append(Issue(path, f"expected a shape string or an array, got {_kind(value)}"))
            return None
        try:
            return normalize_shapes({name: arg})[0][name]
        except EnginekitError as exc:
            issues.append(Issue(path, _strip_input(str(exc), name)))
        except (TypeError, ValueError):
            issues.append(Issue(path, f"{value!r} is not a shape or [min, opt, max] shapes"))
        return None

    def schema(self) -> dict[str, Any]:
        text = {"type": "string", "pattern": f"^{SHAPE_PATTERN}$"}
        dims = {"type": "array", "items": {"type": "integer", "minimum": 0}}
        return {
            "description": self.doc,
            "anyOf": [
                text,
                {"type": "array", "items": text, "minItems": 1, "maxItems": 3},
                dims,
                {"type": "array", "items": dims, "minItems": 3, "maxItems": 3},
            ],
        }


def _strip_input(message: str, name: str) -> str:
    for prefix in (f"shapes for input {name!r}: ", "shape profile "):
        if message.startswith(prefix):
            return message[len(prefix) :] if prefix.startswith("shapes") else message
    return message


_PROFILE = Table(values=ShapeSpec(), doc="one optimization profile: input name -> its shapes")


class Shapes(Node):
    """``[shapes]`` (one profile) or ``[[shapes]]`` (several optimization profiles)."""

    doc = (
        "input shapes: [shapes] maps input name -> shapes (one optimization profile); "
        "[[shapes]] tables give several profiles"
    )

    def check(self, value: Any, path: KeyPath, issues: list[Issue]) -> Any:
        if isinstance(value, dict):
            return [_PROFILE.check(value, path, issues)]
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return [_PROFILE.check(v, (*path, i), issues) for i, v in enumerate(value)]
        issues.append(Issue(path, f"expected [shapes] or [[shapes]] tables, got {_kind(value)}"))
        return None

    def schema(self) -> dict[str, Any]:
        profile = _PROFILE.schema()
        return {
            "description": self.doc,
            "anyOf": [profile, {"type": "array", "items": profile, "minItems": 1}],
        }


class PerPrecision(Node):
    """A limit for every precision (a number) or per precision (``{ fp32 = 1e-4, int8 = 0.05
    }``, ``default`` for the rest); checks to a dict precision|"default" -> number."""

    def __init__(self, value: Num, doc: str) -> None:
        self.value, self.doc = value, doc
        self.table = Table(values=value, key_names=(*PRECISIONS, "default"))

    def check(self, value: Any, path: KeyPath, issues: list[Issue]) -> Any:
        if isinstance(value, dict):
            out = self.table.check(value, path, issues)
            return None if out is None or None in out.values() else out
        checked = self.value.check(value, path, issues)
        return None if checked is None else {"default": checked}

    def schema(self) -> dict[str, Any]:
        return {"description": self.doc, "anyOf": [self.value.schema(), self.table.schema()]}


SPEC = Table(
    {
        "model": Key(
            Table(
                {
                    "source": Key(
                        Str(
                            "an ONNX file (relative to this file), or an exporter entry "
                            "'pkg.module:make_model' whose function returns (model, "
                            "example_inputs), exported through enginekit.export"
                        ),
                        required=True,
                    ),
                    "name": Key(
                        Str(
                            "artifact name prefix: <name>-<backend>-<precision>.ekit (default: "
                            "the ONNX file's stem, or the exporter module's last part)",
                            pattern=NAME_PATTERN,
                            hint="letters, digits, '_', '.', '-'",
                        )
                    ),
                    "export": Key(
                        OpenTable(
                            "exporter entries only: keyword options of enginekit.export, e.g. "
                            "{ dynamic_batch = true, opset = 20 }"
                        )
                    ),
                    "python_path": Key(
                        ListOf(
                            Str(),
                            doc="exporter entries only: folders (relative to this file) put "
                            "first on sys.path to import the entry; default: this file's folder",
                        )
                    ),
                    "outputs": Key(
                        ListOf(
                            Str(),
                            doc="build only the subgraph computing these tensors (intermediate "
                            "ones too; for debugging a mismatch); default: the model's outputs",
                            min_items=1,
                        )
                    ),
                },
                doc="the model to build engines from",
            ),
            required=True,
        ),
        "shapes": Key(Shapes()),
        "engine": Key(
            ArrayOfTables(
                Table(
                    {
                        "backend": Key(
                            Str("registered backend name (enginekit backends lists them)"),
                            required=True,
                        ),
                        "precision": Key(
                            OneOrList(Str(choices=PRECISIONS), doc="precision(s): one entry each"),
                            default="fp32",
                        ),
                        "layout": Key(
                            OneOrList(
                                Str(), doc="layout(s) (backend option 'layout'): one entry each"
                            )
                        ),
                        "variant": Key(
                            Str(
                                "name part that tells entries of one backend apart: "
                                "<name>-<backend>-<variant>-<precision>.ekit",
                                pattern=NAME_PATTERN,
                                hint="letters, digits, '_', '.', '-'",
                            )
                        ),
                        "device": Key(Str("cpu, cuda or cuda:N"), default="cpu"),
                        "options": Key(OpenTable("backend options (enginekit backends --json)")),
                        "verify": Key(
                            Bool("verify against ONNX Runtime CPU at build time"), default=True
                        ),
                        "atol": Key(Num("verification absolute tolerance", minimum=0)),
                        "rtol": Key(
                            Num(
                                "verification relative tolerance: of each output's scale "
                                "max|ref| (scaled rule) or of each element (elementwise)",
                                minimum=0,
                            )
                        ),
                        "rule": Key(
                            Str(
                                "verification rule: scaled (error relative to each output's "
                                "scale, plus cosine similarity) or elementwise",
                                choices=("scaled", "elementwise"),
                            ),
                            default="scaled",
                        ),
                        "min_cosine": Key(
                            Num("verification cosine-similarity floor (scaled rule)", minimum=-1)
                        ),
                        "seed": Key(
                            Num("seed of the verification inputs", integer=True), default=0
                        ),
                        "simplify": Key(
                            Bool(
                                "simplify the graph first (constant folding, dead nodes, shape "
                                "inference)"
                            ),
                            default=True,
                        ),
                    },
                    doc="one matrix row: a backend with its precisions and layouts",
                ),
                doc="engines to build: every [[engine]] x precision x layout is one artifact",
            ),
            required=True,
        ),
        "calibration": Key(
            Table(
                {
                    "data": Key(
                        OneOrList(
                            Str(),
                            doc="int8 calibration data: .npy/.npz files, folders or globs "
                            "(relative to this file)",
                        )
                    ),
                    "method": Key(
                        Str("calibration method", choices=CALIBRATION_METHODS), default="entropy"
                    ),
                    "table": Key(
                        Str("a calibration table JSON (enginekit calibrate) instead of data")
                    ),
                    "verify_data": Key(
                        OneOrList(
                            Str(),
                            doc="data to verify int8 engines on (default: held-out calibration samples)",
                        )
                    ),
                },
                doc="how int8 entries are calibrated",
            )
        ),
        "gates": Key(
            Table(
                {
                    "max_abs_error": Key(
                        PerPrecision(
                            Num(minimum=0),
                            "largest absolute error vs the reference, per precision",
                        )
                    ),
                    "min_top1_agreement": Key(
                        PerPrecision(
                            Num(minimum=0, maximum=1),
                            "lowest top-1 agreement with the reference (0..1), per precision",
                        )
                    ),
                    "max_throughput_regression": Key(
                        Num(
                            "largest throughput loss vs the baseline report, as a fraction "
                            "(0.10 = 10% slower)",
                            minimum=0,
                            maximum=1,
                        )
                    ),
                },
                doc="what fails the build (exit code 3)",
            )
        ),
        "bench": Key(
            Table(
                {
                    "enabled": Key(Bool("benchmark every entry"), default=True),
                    "batch_sizes": Key(
                        ListOf(
                            Num(integer=True, minimum=1),
                            doc="batch sizes (default: the profile's min, opt, max batch)",
                            min_items=1,
                        )
                    ),
                    "duration": Key(
                        Num("timed seconds per batch size", minimum=0, exclusive_minimum=True),
                        default=0.5,
                    ),
                    "rounds": Key(Num("timed rounds", integer=True, minimum=1), default=3),
                    "warmup": Key(Num("untimed seconds per batch size", minimum=0), default=0.1),
                },
                doc="throughput measurement of every entry",
            )
        ),
    },
    doc="enginekit build file (enginekit build -c enginekit.toml)",
)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the build file, generated from :data:`SPEC` (for editors)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://enginekit.dev/schemas/enginekit.schema.json",
        "title": "enginekit.toml",
        **SPEC.schema(),
    }
