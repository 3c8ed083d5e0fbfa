"""The ops real models need, each against its ONNX node test cases, through the whole path.

Every single-op case of ONNX's node test suite for the ops in ``OPS`` (GatherND, ScatterND,
ScatterElements, Scatter, Einsum, CumSum, Trilu, Resize, Upsample, Range, If, and the smaller
ops of ``ops/extra.py``) goes through ``ek.build`` (backend
``xla``, artifact written) and ``ek.load``, and the loaded engine's outputs must match the
case's expected outputs at the case's own tolerance. (``test_xla_ops.py`` checks the whole op
table faster, by lowering many cases into one program; this checks the artifact round trip.)

Shape-deciding inputs are baked in as initializers, as in ``test_xla_ops.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")
onnx = pytest.importorskip("onnx")

from test_xla_ops import _array, _bake  # noqa: E402

import enginekit as ek  # noqa: E402

OPS = (
    "GatherND",
    "ScatterND",
    "ScatterElements",
    "Scatter",
    "Einsum",
    "CumSum",
    "Trilu",
    "Resize",
    "Upsample",
    "Range",
    "If",
    "Shrink",
    "Swish",
    "BitShift",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "CumProd",
    "MeanVarianceNormalization",
    "GroupNormalization",
    "RMSNormalization",
    "OneHot",
    "ReverseSequence",
)
#: Cases of those ops that need what the backend does not offer: name -> reason.
EXCLUDED = {
    "test_if_seq": "sequence values are not supported (tensors only)",
    "test_if_opt": "optional values are not supported (tensors only)",
}


def _cases() -> dict[str, object]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = node.collect_testcases(None)
    return {
        c.name: c
        for c in found
        if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in OPS
    }


CASES = _cases()


def test_every_listed_op_has_node_cases():
    covered = {c.model.graph.node[0].op_type for c in CASES.values()}
    assert covered == set(OPS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_case_builds_loads_and_matches(name, tmp_path):
    if name in EXCLUDED:
        pytest.skip(EXCLUDED[name])
    case = CASES[name]
    inputs, outputs = case.data_sets[0]
    model, runtime = _bake(case.model, list(inputs))
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    ek.build(
        path, backend="xla", output=tmp_path / "engine/", verify=False, xla_flags="xla-default"
    )
    with ek.load(tmp_path / "engine") as engine:
        got = engine.infer(runtime)
    for spec, want in zip(engine.outputs, outputs):
        want = _array(want)
        have = got[spec.name]
        assert have.shape == want.shape, spec.name
        assert have.dtype == want.dtype, spec.name
        if np.issubdtype(want.dtype, np.inexact):
            np.testing.assert_allclose(have, want, rtol=case.rtol, atol=case.atol)
        else:
            np.testing.assert_array_equal(have, want)
