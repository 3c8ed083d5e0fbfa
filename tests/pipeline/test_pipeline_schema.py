"""The JSON Schema for editors: generated from the build-file spec, kept in docs/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib

from enginekit.pipeline.spec import json_schema

ROOT = Path(__file__).parent.parent.parent


def test_docs_copy_matches_the_generator():
    stored = json.loads((ROOT / "docs" / "enginekit.schema.json").read_text(encoding="utf-8"))
    assert stored == json_schema(), (
        "docs/enginekit.schema.json is stale: enginekit validate --schema > docs/enginekit.schema.json"
    )


def doc_examples() -> list[str]:
    text = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    return re.findall(r"```toml\n(.*?)```", text, flags=re.S)


def test_schema_is_valid_and_accepts_the_documented_examples():
    jsonschema = pytest.importorskip("jsonschema", reason="checks the schema with a real validator")
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    examples = doc_examples()
    assert examples, "docs/ci.md has no toml example"
    for text in examples:
        jsonschema.validate(tomllib.loads(text), schema)


def test_schema_rejects_what_the_validator_rejects():
    jsonschema = pytest.importorskip("jsonschema", reason="checks the schema with a real validator")
    schema = json_schema()
    bad = [
        {"model": {"source": "m.onnx"}, "engine": [{"backend": "onnxruntime", "precison": "fp32"}]},
        {"model": {"source": "m.onnx"}, "engine": [{"backend": "onnxruntime", "precision": "fp8"}]},
        {"model": {"source": "m.onnx"}, "engine": [], "shapes": {"x": "4by16"}},
        {
            "model": {"source": "m.onnx"},
            "engine": [{"backend": "x"}],
            "gates": {"max_abs_error": {"in8": 1}},
        },
        {"engine": [{"backend": "onnxruntime"}]},
    ]
    for doc in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def test_documented_examples_pass_the_type_checks():
    from enginekit.pipeline.spec import SPEC

    for text in doc_examples():
        issues: list = []
        SPEC.check(tomllib.loads(text), (), issues)
        assert issues == []


def test_ci_doc_python_example_runs(project, monkeypatch):
    import shutil

    shutil.copy(project.root / "mlp.onnx", project.root / "classifier.onnx")
    project.write(
        '[model]\nsource = "classifier.onnx"\n[shapes]\nx = "1x16,4x16,8x16"\n'
        '[[engine]]\nbackend = "onnxruntime"\n[bench]\nenabled = false\n'
    )
    (block,) = re.findall(
        r"```python\n(.*?)```", (ROOT / "docs" / "ci.md").read_text(encoding="utf-8"), flags=re.S
    )
    monkeypatch.chdir(project.root)
    namespace: dict = {}
    exec(compile(block, "docs/ci.md", "exec"), namespace)
    assert namespace["report"]["exit_code"] == 0
    assert (
        project.root / "model_repository" / "classifier-onnxruntime-fp32" / "config.pbtxt"
    ).is_file()
