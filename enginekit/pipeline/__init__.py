"""CI pipelines: a build file (``enginekit.toml``) -> a matrix of verified engine artifacts,
a content-addressed cache, a report with gates, and Triton model repository entries.

    from enginekit import pipeline
    report = pipeline.run("enginekit.toml", out="dist", cache=".enginekit-cache")
    report["exit_code"]  # 0 ok, 1 build error, 3 gate failed

Modules: ``config`` (TOML -> validated specs, JSON Schema), ``matrix`` (entries, parallel
builds), ``cache``, ``report`` (gates, baseline, Markdown), ``triton``, ``runner``.
"""

from __future__ import annotations

from typing import Any

from enginekit.pipeline.cache import Cache
from enginekit.pipeline.config import ConfigError, PipelineConfig, load
from enginekit.pipeline.spec import json_schema


def run(config: Any, **kwargs: Any) -> dict[str, Any]:
    """Build, bench and gate every entry of a build file; see :func:`enginekit.pipeline.runner.run`."""
    from enginekit.pipeline.runner import run as _run

    return _run(config, **kwargs)


def export_triton(artifact: Any, repo: Any, **kwargs: Any) -> dict[str, Any]:
    """Write a Triton model repository entry; see :func:`enginekit.pipeline.triton.export_triton`."""
    from enginekit.pipeline.triton import export_triton as _export

    return _export(artifact, repo, **kwargs)


__all__ = ["Cache", "ConfigError", "PipelineConfig", "export_triton", "json_schema", "load", "run"]
