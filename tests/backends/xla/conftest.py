"""Fixtures shared by the XLA backend's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def compile_events():
    """Names of XLA backend compiles recorded while the test runs (one per executable)."""
    jax = pytest.importorskip("jax", reason="the XLA backend needs jax")
    from jax._src import monitoring as internal

    seen: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    internal.unregister_event_duration_listener(listen)
