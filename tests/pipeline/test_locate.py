"""Line numbers of TOML keys, which tomllib does not give."""

from __future__ import annotations

import tomllib

from enginekit.pipeline.locate import format_path, key_lines, line_of

TEXT = '''\
# a comment [not = "a table"]
[model]
source = "models/classifier.onnx"   # trailing comment
[shapes]
x = ["1x3x224x224",
     "8x3x224x224",   # a comment inside an array
     "32x3x224x224"]
"input.1" = "1x3"
[[engine]]
backend = "onnxruntime"
options = { intra_op_threads = 1, nested = { level = "all" } }
[[engine]]
backend = "tvm"
[engine.options]
note = 'x = 1'
[calibration]
data = """
fake = 1
"""
method = "entropy"
[gates]
max_abs_error = { fp32 = 1e-4, "int8" = 0.05 }
dotted.key = 1
'''


def test_every_key_gets_its_line():
    assert tomllib.loads(TEXT)  # the sample is valid TOML
    lines = key_lines(TEXT)
    expected = {
        ("model", "source"): 3,
        ("shapes", "x"): 5,
        ("shapes", "input.1"): 8,
        ("engine", 0, "backend"): 10,
        ("engine", 0, "options", "intra_op_threads"): 11,
        ("engine", 0, "options", "nested", "level"): 11,
        ("engine", 1, "backend"): 13,
        ("engine", 1, "options"): 14,
        ("engine", 1, "options", "note"): 15,
        ("calibration", "data"): 17,
        ("calibration", "method"): 20,
        ("gates", "max_abs_error", "int8"): 22,
        ("gates", "dotted", "key"): 23,
    }
    assert {k: lines.get(k) for k in expected} == expected


def test_keys_inside_strings_and_comments_are_not_keys():
    lines = key_lines(TEXT)
    assert ("calibration", "fake") not in lines
    assert ("not",) not in lines
    assert ("engine", 1, "options", "x") not in lines


def test_array_items_fall_back_to_the_key_holding_them():
    assert line_of(key_lines(TEXT), ("shapes", "x", 2)) == 5
    assert line_of(key_lines(TEXT), ("nowhere",)) is None


def test_paths_read_like_toml():
    assert format_path(("engine", 1, "precision")) == "engine[1].precision"
    assert format_path(("shapes", "input.1")) == 'shapes."input.1"'
    assert format_path(()) == "(top level)"
