"""progress.py: native stderr output is held back during a block, and given back on failure."""

from __future__ import annotations

import os

import pytest

from enginekit.quiet import held_output


def test_native_output_is_held_back_when_the_block_succeeds(capfd):
    with held_output("test"):
        os.write(2, b"I0000 noisy C++ log line\n")
    assert "noisy" not in capfd.readouterr().err


def test_native_output_is_written_back_when_the_block_fails(capfd):
    with pytest.raises(RuntimeError), held_output("test"):
        os.write(2, b"the context of the failure\n")
        raise RuntimeError("boom")
    assert "the context of the failure" in capfd.readouterr().err


def test_python_prints_are_held_back_too_and_can_stay_hidden_on_failure(capfd):
    with pytest.raises(RuntimeError), held_output("test", show_on_error=False):
        print("Error converting operator Foo")
        raise RuntimeError("the caller's error says it")
    captured = capfd.readouterr()
    assert "Error converting" not in captured.out + captured.err
