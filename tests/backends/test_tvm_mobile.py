"""enginekit's TVM CPU schedules for what MobileNet-style models spend their time in besides
regular convolutions: classifier matmuls over a symbolic batch and small kernels given two
schedules chosen at run time, whose constant weights are repacked once for both branches."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reference

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def _dense(k: int, n: int):
    """``x @ w`` over a symbolic batch ``b``, ``w`` marked a constant (layout-free) weight."""
    from tvm.script import tirx as T

    kk, nn = T.int64(k), T.int64(n)

    @T.prim_func(private=True, s_tir=True)
    def dense(x_h: T.handle, w: T.Buffer((kk, nn), "float32"), y_h: T.handle):
        T.func_attr({"layout_free_buffers": [1]})
        b = T.int64()
        x = T.match_buffer(x_h, (b, kk), "float32")
        y = T.match_buffer(y_h, (b, nn), "float32")
        for i, j, r in T.grid(b, nn, kk):
            with T.sblock("matmul"):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + x[vi, vr] * w[vr, vj]

    return dense


def _top_level(func):
    """The statements directly under the root block of ``func``."""
    from tvm import tirx

    body = func.body.block.body
    return list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]


@pytest.mark.parametrize("k,n", [(1024, 1000), (576, 1024), (64, 48)])
@pytest.mark.parametrize("lanes", [8, 16])
def test_schedules_chosen_at_run_time_read_one_weight_repacked_before_the_branch(k, n, lanes):
    # The classifier matmuls of MobileNetV3 at batch 16 read their weight rows 4 KiB apart
    # (1.6 of 6.2 ms at 32 GF/s): a run-time choice between padded and unpadded rows (and,
    # for small kernels, between a parallel and a serial schedule) kept them unpacked.
    from tvm import s_tir, tirx

    from enginekit.backends.tvm import packing, schedule

    func = schedule.schedule_cpu(_dense(k, n), lanes).mod["main"]
    script = func.script()
    top = _top_level(func)
    # One repacking, at the top level (TVM's split finds it there), then the choice.
    assert script.count(packing.PREPACK) == 1
    assert isinstance(top[-1], tirx.IfThenElse) and len(top) == 2
    nest = top[0]
    while isinstance(nest, tirx.For):
        nest = nest.body
    assert isinstance(nest, s_tir.SBlockRealize) and packing.PREPACK in nest.block.annotations
    packed = nest.block.writes[0].source
    *tiles, width = (int(d) for d in packed.shape)
    assert tiles == [n // width, k] and n % width == 0
    # Every multiply-add of every branch reads the packed weight, none the original.
    updates = script.count('T.sblock("matmul_update")')
    assert updates >= 2 and script.count(f"* {packed.name}[") == updates


def test_small_kernels_chosen_at_run_time_are_packed_once_for_both_thread_counts():
    # 64 x 48 is below PARALLEL_WORK per row: a parallel and a serial schedule, each with a
    # padded-row and an unpadded branch: four branches, one packed weight.
    from enginekit.backends.tvm import packing, schedule

    script = schedule.schedule_cpu(_dense(64, 48), 16).mod.script()
    assert "T.parallel" in script and "T.int64(65536)" in script  # the nested choice
    assert script.count(packing.PREPACK) == 1


def test_two_schedules_that_pack_a_weight_in_two_layouts_are_refused():
    # TVM's SplitLayoutRewritePreproc takes one repacking per weight parameter: two layouts
    # cannot both be the parameter, so the rule falls back to unpacked weights instead.
    from tvm import s_tir
    from tvm.s_tir import dlight

    from enginekit.backends.tvm import packing, reduction

    def packed(width: int):
        sch = s_tir.Schedule(_dense(64, 64))
        infos = dlight.normalize_prim_func(sch)
        reduction._schedule_reduction(sch, infos, 0, 16, True, pack=True, pack_width=width)
        return sch

    with pytest.raises(packing._PackConflict):
        packing._Chosen(packed(16), packed(32), True)


# AVX2 code (Zen 3's, 8 lanes) runs on an AVX-512 host too: both tile families computed.
@pytest.mark.parametrize("target", [None, {"kind": "llvm", "mcpu": "znver3"}])
def test_a_classifier_matmul_keeps_its_weight_packed_as_one_constant_and_computes_right(
    tmp_path, target
):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from enginekit.backends.tvm import frontend, lower
    from enginekit.target import missing_features

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 200)).astype(np.float32)
    bias = rng.standard_normal(200).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "bias"], ["a"]),
            helper.make_node("HardSwish", ["a"], ["y"]),
        ],
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 200])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")],
    )
    path = tmp_path / "classifier.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    resolved = lower.resolve_target(target, "cpu")
    if missing_features(lower.target_requirements(resolved)):
        pytest.skip("this host cannot run Zen 3 (AVX2) code")
    _, fused, _ = lower.optimize(frontend.import_onnx(ek.load_model(path)), resolved, "NHWC")
    scheduled, _ = lower.apply_schedules(fused, resolved, "enginekit")
    kernels = [gv.name_hint for gv in scheduled.get_global_vars() if "matmul" in gv.name_hint]
    # The repacking was folded at build: one kernel, called on a 3-d packed constant.
    assert len(kernels) == 1 and kernels[0].endswith("_prepacked"), kernels
    assert len(scheduled[kernels[0]].params[1].shape) == 3
    options = {"target": target} if target is not None else {}
    engine = ek.build(path, backend="tvm", shapes={"x": [(1, 96), (8, 96), (16, 96)]}, **options)
    with engine:
        for batch in (1, 3, 8, 13, 16):  # the unpadded branch, and padded rows
            x = rng.standard_normal((batch, 96)).astype(np.float32)
            got, want = engine.infer({"x": x}), reference(path, {"x": x})
            np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4)


def test_padded_rows_over_half_vector_columns_are_four_rows_by_five_half_vectors():
    # 1000 columns take 8-lane vectors on AVX-512: 8 rows x 1 vector loaded 8 row values
    # and 1 weight vector per 8 FMAs; 4 rows x 5 vectors load 4 and 5 per 20 (MobileNetV3's
    # 1024x1000 classifier at batch 16, one thread, in the model: 790 -> 490 us).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_dense(64, 1000), 16).mod.script()
    padded = script[script.index("if b >= T.int64(8)") :]
    tile = padded[padded.index('T.sblock("matmul_update")') - 400 :]
    assert "for ax0_1 in T.unroll(T.int64(4))" in tile
    assert "T.unroll(T.int64(5))" in tile and "T.vectorized(T.int64(8))" in tile
    # Both branches read one weight packed in 40-column tiles.
    assert "(T.int64(25), T.int64(64), T.int64(40))" in script
    # AVX2's 8 lanes divide 1000: whole vectors, 4 rows (the register block there).
    avx2 = schedule.schedule_cpu(_dense(64, 1000), 8).mod.script()
    assert "(T.int64(25), T.int64(64), T.int64(40))" not in avx2
