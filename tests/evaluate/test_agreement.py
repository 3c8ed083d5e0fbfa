"""The accuracy gate of --backend auto: which precisions it tries on this host, the shared
batch, top-1 agreement and the gate itself."""

from __future__ import annotations

import numpy as np
import pytest
from compare_helpers import tiny_mlp

import enginekit as ek
from enginekit import target
from enginekit.evaluate import agreement
from enginekit.evaluate.agreement import Agreement, gate, host_precisions
from enginekit.model import load_model


@pytest.fixture
def flags(monkeypatch):
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(target, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_host_precisions_add_bf16_only_with_bf16_instructions_and_int8_only_with_data(flags):
    flags("avx2", "fma")
    chosen, left = host_precisions("cpu", calibrated=False)
    assert chosen == ["fp32"]
    assert "no bf16 instructions" in left["bf16"] and "calibration data" in left["int8"]
    flags("avx512f", "avx512_vnni", "avx512_bf16")
    chosen, left = host_precisions("cpu", calibrated=True)
    assert chosen == ["fp32", "bf16", "int8"] and set(left) == {"fp16"}
    assert host_precisions("cuda:0", calibrated=False)[0] == ["fp32", "fp16", "bf16"]


def test_gate_holds_reduced_precisions_to_the_floor_and_reports_fp32():
    low = Agreement(top1=0.95, cosine=0.999, rows=100)
    assert gate("fp32", low, 0.99) is None  # fp32 answers to the verification rule
    why = gate("int8", low, 0.99)
    assert why is not None and "95.00%" in why and "99.00%" in why and "100 rows" in why
    assert gate("bf16", Agreement(0.99, 1.0, 100), 0.99) is None
    assert gate("int8", Agreement(None, 0.9, 8), 0.99) is None  # nothing class-like to compare


def test_measure_compares_argmax_per_row_and_cosine(tmp_path):
    model = load_model(tiny_mlp(tmp_path / "mlp.onnx"))
    chunks, described = agreement.batch(model, None, 8)
    assert [c["x"].shape for c in chunks] == [(8, 16)] and "generated" in described
    ref = agreement.reference(model, chunks)
    engine = ek.build(model, shapes={"x": [(1, 16), (8, 16), (16, 16)]})
    same = agreement.measure(engine, chunks, ref)
    assert same.top1 == 1.0 and same.cosine == pytest.approx(1.0) and same.rows == 8
    flipped = {"output": -ref["output"]}  # every arg-max moves (ties aside)
    assert agreement.measure(engine, chunks, flipped).top1 < 0.5
    engine.close()


def test_shared_batch_prefers_verify_data_then_held_out_calibration_rows(tmp_path):
    model = load_model(tiny_mlp(tmp_path / "mlp.onnx"))
    rows = np.arange(40 * 16, dtype=np.float32).reshape(40, 16)
    chunks, described = agreement.batch(model, None, 8, verify_data=rows[:5])
    assert described == "verify_data" and [c["x"].shape for c in chunks] == [(5, 16)]
    chunks, described = agreement.batch(model, None, 8, calib_data=rows)
    assert "4 calibration rows held out" in described
    held = np.concatenate([c["x"] for c in chunks])
    np.testing.assert_array_equal(held, rows[9::10])  # the rows build never calibrates on
    once = iter([rows])  # a one-shot iterator stays whole for the builds
    assert "generated" in agreement.batch(model, None, 8, calib_data=once)[1]


def test_a_fixed_batch_model_gets_the_shared_batch_in_its_own_batch_size(tmp_path):
    from compare_helpers import tiny_mlp as mlp

    path = tmp_path / "fixed.onnx"
    import onnx

    proto = onnx.load(str(mlp(tmp_path / "m.onnx")))
    for v in (*proto.graph.input, *proto.graph.output):
        v.type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save(proto, str(path))
    model = load_model(path)
    rows = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
    chunks, _ = agreement.batch(model, None, 4, verify_data=rows)
    assert [c["x"].shape for c in chunks] == [(4, 16)] * 3
    engine = ek.build(model)
    assert agreement.measure(engine, chunks, agreement.reference(model, chunks)).rows == 12
    engine.close()
