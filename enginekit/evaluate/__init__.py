"""Evaluation tools: engines measured against a reference and against each other.

:mod:`~enginekit.evaluate.compare` runs the same inputs through backends and checks every output;
:mod:`~enginekit.evaluate.bench` times engines per batch size; :mod:`~enginekit.evaluate.choose`
is ``backend="auto"`` (build every candidate, verify, bench, keep the best). They sit above
:mod:`enginekit.build`: they build and load engines, and nothing below imports them.
"""
