"""``ek.load(path, threads=, spinning=)``: options checked against what each backend honours."""

from __future__ import annotations

import pytest

from enginekit import backends
from enginekit.errors import UsageError


@pytest.mark.parametrize("name", ["tvm", "xla", "tensorrt"])
def test_backends_without_load_options_refuse_them_naming_none(name):
    with pytest.raises(
        UsageError, match=rf"{name!r} cannot set 'threads' at load \(its load options: none\)"
    ):
        backends.check_load_options(backends.get(name), {"threads": 2, "spinning": None})


def test_unset_options_are_dropped_and_honoured_ones_pass():
    ort = backends.get("onnxruntime")
    assert backends.check_load_options(ort, {"threads": None, "spinning": None}) == {}
    assert backends.check_load_options(ort, {"threads": 1, "spinning": True}) == {
        "threads": 1,
        "spinning": True,
    }


def test_every_backend_load_option_is_a_documented_one():
    for name in backends.names():
        honoured = getattr(backends.get(name), "LOAD_OPTIONS", {})
        assert set(honoured) <= set(backends.LOAD_OPTIONS), name
