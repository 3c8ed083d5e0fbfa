"""enginekit's default TVM CPU schedules (enginekit/backends/tvm/schedule.py): matmuls over a
symbolic batch, weight-bound kernels, numerics at batch sizes that are not block multiples."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import reference, save_graph
from tvm_conv_case import conv_relu_reference, fused_conv_relu

import enginekit as ek

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def _fused(path):
    from enginekit.backends.tvm import frontend, lower, simd

    target = lower.resolve_target(None, "cpu")
    _, fused, _ = lower.optimize(frontend.import_onnx(ek.load_model(path)), target, "NHWC")
    return fused, simd.vector_lanes(target)


def test_matmul_over_a_symbolic_batch_gets_a_padded_row_block_and_an_unpadded_branch(mlp_path):
    # Called directly: ApplyDefaultSchedule would swallow an error and fall back to naive loops.
    from enginekit.backends.tvm import schedule, simd

    fused, lanes = _fused(mlp_path)
    rows = simd._rows_block(lanes)  # 4 with AVX2's 8 lanes, 8 with AVX-512's 16
    scripts = {
        gv.name_hint: schedule.schedule_cpu(func, lanes).mod.script()
        for gv, func in fused.functions_items()
        if "matmul" in gv.name_hint
    }
    assert len(scripts) == 2
    for name, script in scripts.items():
        # Rows padded to the register block (no predicate inside the K loop), chosen at run
        # time against the plain schedule for a batch below the block.
        assert "_pad_local" in script, name
        assert f"batch >= T.int64({rows})" in script or f"T.int64({rows}) <= batch" in script, name
        assert "parallel" in script and "vectorized" in script, name


@pytest.mark.slow
def test_padded_rows_give_the_reference_result_at_every_batch_size(mlp_path):
    engine = ek.build(mlp_path, backend="tvm", shapes={"x": [(1, 16), (8, 16), (16, 16)]})
    rng = np.random.default_rng(0)
    with engine:
        for batch in (1, 3, 4, 5, 16):  # below, at, between and at a multiple of the block
            x = rng.standard_normal((batch, 16)).astype(np.float32)
            got = engine.infer({"x": x})
            want = reference(mlp_path, {"x": x})
            for name, value in want.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


def _gemv(k: int, n: int):
    """A batch-1 matmul ``(1, k) @ (k, n)``."""
    from tvm.script import tirx as T

    kk, nn = T.int64(k), T.int64(n)

    @T.prim_func(private=True, s_tir=True)
    def gemv(
        a: T.Buffer((T.int64(1), kk), "float32"),
        w: T.Buffer((kk, nn), "float32"),
        c: T.Buffer((T.int64(1), nn), "float32"),
    ):
        for i, j, r in T.grid(T.int64(1), nn, kk):
            with T.sblock("matmul"):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vr] * w[vr, vj]

    return gemv


def test_a_weight_bound_kernel_puts_the_output_channel_tiles_outermost():
    from tvm import s_tir
    from tvm.s_tir import dlight

    from enginekit.backends.tvm import placement, schedule

    gemv = _gemv(256, 512)
    sch = s_tir.Schedule(gemv)
    info = dlight.normalize_prim_func(sch)[0]
    assert placement._weight_bound(sch, info.block_rv)
    script = schedule.schedule_cpu(gemv, 8).mod.script()
    # One row: no block to reuse a weight vector across rows, so the tile is several vectors
    # wide (independent FMA chains, 4 cache lines of each weight row) instead of one.
    assert "T.unroll(T.int64(8))" in script and "T.vectorized(T.int64(8))" in script


def test_a_tile_of_five_vectors_is_vectorized_one_vector_at_a_time():
    # A <40 x float> vector is legalized badly by LLVM: MobileNetV3's 1024x1000 classifier at
    # batch 1 ran 2x slower than with five unrolled 8-lane steps (AVX2, one thread).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_gemv(64, 1000), 8).mod.script()
    assert "T.vectorized(T.int64(40))" not in script
    assert "T.unroll(T.int64(5))" in script and "T.vectorized(T.int64(8))" in script


def test_a_wide_tile_on_avx512_is_made_of_half_vectors_where_whole_ones_do_not_fit():
    # 1000 columns are no multiple of 16: the tile was one <10 x float> vector, a single FMA
    # chain (ResNet-50's 2048x1000 classifier at batch 1, alone, one thread: 333 -> 155 us).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_gemv(64, 1000), 16).mod.script()
    assert "T.vectorized(T.int64(10))" not in script
    assert "T.unroll(T.int64(5))" in script and "T.vectorized(T.int64(8))" in script


def _add(shape: tuple[int, int]):
    from tvm.script import tirx as T

    rows, cols = (T.int64(d) for d in shape)

    @T.prim_func(private=True, s_tir=True)
    def add(
        a: T.Buffer((rows, cols), "float32"),
        b: T.Buffer((rows, cols), "float32"),
        c: T.Buffer((rows, cols), "float32"),
    ):
        for i, j in T.grid(rows, cols):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = a[vi, vj] + b[vi, vj]

    return add


def test_a_kernel_smaller_than_a_parallel_launch_runs_on_one_thread():
    from enginekit.backends.tvm import schedule

    small = schedule.schedule_cpu(_add((8, 64)), 8).mod.script()
    large = schedule.schedule_cpu(_add((1024, 256)), 8).mod.script()
    assert "parallel" not in small and "vectorized" in small
    assert "parallel" in large


@pytest.mark.parametrize("rows", [(8,), ("n", 5)])
def test_an_outer_product_with_an_epilogue_adds_the_bias_once(tmp_path, rows):
    # MatMul over K = 1 then Add (LinearAttention's state update): its unit reduction loop is
    # normalized away, the block was taken for injective and the Add inlined into both its
    # init and its update, adding the bias twice.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((2, 1, 8)).astype(np.float32)
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [*rows, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, 8])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        "outer",
        [a],
        [y],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b[0], "b")],
    )
    path = tmp_path / "outer.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    shape = (8, 1) if len(rows) == 1 else (3, 5, 1)
    shapes = None if len(rows) == 1 else {"a": [(1, 5, 1), (4, 5, 1), (8, 5, 1)]}
    with ek.build(path, backend="tvm", shapes=shapes, verify=False) as e:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(e.infer({"a": x})["y"], x @ w + b[0], rtol=1e-5, atol=1e-6)


def test_a_compile_failure_with_run_time_choices_is_retried_without_them(mlp_path, monkeypatch):
    # TVM 0.27's lowering fails ("Find divide by zero") on some kernels given two schedules
    # chosen at run time (torchvision's ViT and Swin, timm's MobileViT): the build compiles
    # again with one schedule per kernel instead of failing the model.
    from enginekit.backends.tvm import lower

    real_apply, real_compile = lower.apply_schedules, lower.compile_module
    calls: list[bool] = []

    def apply(mod, target, schedule, database=None, choices=True, knobs=None):
        calls.append(choices)
        return real_apply(mod, target, schedule, database, choices, knobs)

    def compile_once_failing(mod, target):
        if len(calls) == 1:
            raise ek.BuildError("TVM failed to compile the program for llvm: divide by zero")
        return real_compile(mod, target)

    monkeypatch.setattr(lower, "apply_schedules", apply)
    monkeypatch.setattr(lower, "compile_module", compile_once_failing)
    x = {"x": np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)}
    with ek.build(mlp_path, backend="tvm") as e:
        got, want = e.infer(x), reference(mlp_path, x)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    assert calls[:2] == [True, False]


def _conv_nhwc(pixels: int, channels: int, k: int = 3):
    """A k x k NHWC/HWIO convolution (no padding) at batch 1 with ``pixels`` x ``pixels``
    outputs."""
    from tvm.script import tirx as T

    side, c, hw = T.int64(pixels + k - 1), T.int64(channels), T.int64(pixels)
    kk = T.int64(k)

    @T.prim_func(private=True, s_tir=True)
    def conv(
        x: T.Buffer((T.int64(1), side, side, c), "float32"),
        w: T.Buffer((kk, kk, c, c), "float32"),
        y: T.Buffer((T.int64(1), hw, hw, c), "float32"),
    ):
        for n, h, ww, co, rh, rw, ci in T.grid(T.int64(1), hw, hw, c, kk, kk, c):
            with T.sblock("conv"):
                vn, vh, vw, vc, vrh, vrw, vci = T.axis.remap("SSSSRRR", [n, h, ww, co, rh, rw, ci])
                with T.init():
                    y[vn, vh, vw, vc] = T.float32(0)
                y[vn, vh, vw, vc] += x[vn, vh + vrh, vw + vrw, vci] * w[vrh, vrw, vci, vc]

    return conv


def test_a_weight_bound_conv_puts_the_channel_tiles_right_after_the_batch():
    # ResNet-50's last stage at small inputs (2x2 pixels, 9 MB of weights): with the channel
    # tiles innermost every row of pixels streamed the whole weight, and so did each thread.
    from enginekit.backends.tvm import schedule

    deep = schedule.schedule_cpu(_conv_nhwc(2, 64), 8).mod.script()
    wide = schedule.schedule_cpu(_conv_nhwc(32, 64), 8).mod.script()
    # Loops as normalized: the unit batch dropped, ax0/ax1 the rows and columns, ax2 channels.
    assert "for ax2_0_ax0_fused in T.parallel" in deep
    assert "for ax0_ax1_0_ax2_0_fused in T.parallel" in wide  # pixels outside: shared inputs


def test_a_pointwise_conv_over_fewer_columns_than_a_block_blocks_rows_and_columns_fused():
    # 2x2 pixels: blocked by its 2 columns the tile had 4 FMA chains; fused, 4 pixels x 2
    # vectors make 8 (ResNet-50's last 1x1 convs at 64x64 inputs, 1.8x faster on one thread).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_conv_nhwc(2, 256, k=1), 8).mod.script()
    assert "for ax0_ax1_fused in T.unroll(T.int64(4))" in script


def test_a_constant_conv_weight_is_repacked_in_channel_tiles_only_where_marked():
    # HWIO weights read 16 channels per step a row apart: ResNet-50's 3x3 convs over 2x2
    # pixels streamed them at 13-16 GF/s on one thread; packed [O/16, H, W, I, 16], 2-2.4x.
    from enginekit.backends.tvm import packing, schedule

    conv = _conv_nhwc(4, 64)
    marked = schedule.schedule_cpu(conv.with_attr("layout_free_buffers", [1]), 8).mod
    plain = schedule.schedule_cpu(conv, 8).mod.script()
    assert packing.PREPACK in marked.script() and packing.PREPACK not in plain
    assert "(T.int64(4), T.int64(3), T.int64(3), T.int64(64), T.int64(16))" in marked.script()


def test_repacked_weights_are_folded_at_build_and_give_the_reference_result():
    import tvm
    from tvm import relax

    from enginekit.backends.tvm import lower, simd

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 4, 4, 32), "float32"))
    w = rng.standard_normal((3, 3, 32, 64)).astype("float32")
    fused, target = fused_conv_relu(x, w)
    # enginekit packs with numpy; TVM's FoldConstant would compile each repacking kernel.
    folded = []
    real_fold = lower.fold_repacking
    lower.fold_repacking = lambda m: folded.append(1) or real_fold(m)
    try:
        scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    finally:
        lower.fold_repacking = real_fold
    assert folded
    # The repacking ran at build: main calls only the conv kernel, on a 5-d constant.
    names = [gv.name_hint for gv in scheduled.get_global_vars()]
    assert not any("prepack" in n and "prepacked" not in n for n in names), names
    (kernel,) = lower.kernel_summary(scheduled)
    assert kernel["name"] == "fused_conv2d_relu"  # the manifest's name, before scheduling
    func = next(f for gv, f in scheduled.functions_items() if gv.name_hint.endswith("prepacked"))
    # Output-channel tiles of whole vectors: 16 channels on AVX2, 32 on AVX-512.
    *outer, tile = (int(d) for d in func.params[1].shape)
    assert tile % simd.vector_lanes(target) == 0 and tile < 64, tile
    assert outer == [64 // tile, 3, 3, 32]
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=target), tvm.cpu())
    data = rng.standard_normal((1, 4, 4, 32)).astype("float32")
    got = vm["main"](tvm.runtime.tensor(data)).numpy()
    want = conv_relu_reference(data, w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_block_of_two_pixels_is_four_vectors_wide():
    # 2 columns (a 3x3 conv over 2x2 pixels): 2 pixels x 2 vectors were 4 FMA chains;
    # 4 vectors make 8 (ResNet-50's last 3x3 convs, 25-30% faster on one thread).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_conv_nhwc(2, 64), 8).mod.script()
    assert "T.unroll(T.int64(4))" in script and "T.vectorized(T.int64(8))" in script
    assert "T.vectorized(T.int64(16))" not in script


def _scores():
    """Attention scores ``q @ k`` over a symbolic sequence: both output axes symbolic."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def scores(q_h: T.handle, k_h: T.handle, s_h: T.handle):
        n = T.int64()
        q = T.match_buffer(q_h, (T.int64(8), n, T.int64(32)), "float32")
        k = T.match_buffer(k_h, (T.int64(8), T.int64(32), n), "float32")
        s = T.match_buffer(s_h, (T.int64(8), n, n), "float32")
        for b, i, j, r in T.grid(T.int64(8), n, n, T.int64(32)):
            with T.sblock("matmul"):
                vb, vi, vj, vr = T.axis.remap("SSSR", [b, i, j, r])
                with T.init():
                    s[vb, vi, vj] = T.float32(0)
                s[vb, vi, vj] = s[vb, vi, vj] + q[vb, vi, vr] * k[vb, vr, vj]

    return scores


def test_a_symbolic_vector_axis_is_padded_to_two_vectors_and_vectorized():
    # Unpadded, attention scores over a symbolic sequence were one scalar FMA chain per output
    # element with its indices recomputed by symbolic divisions (13 of 31 ms in a small BERT).
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_scores(), 8).mod.script()
    assert "_pad" in script and "(n + T.int64(15)) // T.int64(16) * T.int64(16)" in script
    assert "T.vectorized(T.int64(16))" in script and "T.unroll(T.int64(4))" in script


def test_a_symbolic_innermost_axis_stays_out_of_the_parallel_loop():
    # Fused into the parallel loop, each element of a transpose over a symbolic sequence
    # recomputed its indices by symbolic divisions (1.1 ms where the static one took 0.1).
    from tvm.script import tirx as T

    from enginekit.backends.tvm import schedule

    @T.prim_func(private=True, s_tir=True)
    def transpose(x_h: T.handle, y_h: T.handle):
        n = T.int64()
        x = T.match_buffer(x_h, (T.int64(64), n, T.int64(32)), "float32")
        y = T.match_buffer(y_h, (T.int64(64), T.int64(32), n), "float32")
        for a, b, c in T.grid(T.int64(64), T.int64(32), n):
            with T.sblock("T_transpose"):
                va, vb, vc = T.axis.remap("SSS", [a, b, c])
                y[va, vb, vc] = x[va, vc, vb]

    script = schedule.schedule_cpu(transpose, 8).mod.script()
    assert "T.parallel(T.int64(2048))" in script and "in range(n)" in script


def test_a_head_transpose_is_parallel_over_batch_and_heads_without_symbolic_divisions():
    # Fused through the sequence, each vector of the output recovered batch, head and
    # position by divisions by the symbolic sequence (0.031 ms where the static one took 0.014).
    from tvm.script import tirx as T

    from enginekit.backends.tvm import schedule

    @T.prim_func(private=True, s_tir=True)
    def heads(x_h: T.handle, y_h: T.handle):
        b, n = T.int64(), T.int64()
        x = T.match_buffer(x_h, (b, n, T.int64(128)), "float32")
        y = T.match_buffer(y_h, (b, T.int64(4), n, T.int64(32)), "float32")
        for i, h, s, d in T.grid(b, T.int64(4), n, T.int64(32)):
            with T.sblock("T_transpose"):
                vi, vh, vs, vd = T.axis.remap("SSSS", [i, h, s, d])
                y[vi, vh, vs, vd] = x[vi, vs, vh * T.int64(32) + vd]

    script = schedule.schedule_cpu(heads, 8).mod.script()
    assert "T.parallel(b * T.int64(4))" in script and "T.grid(n," in script
    assert "// n" not in script and "% n" not in script


def test_attention_scores_over_a_symbolic_sequence_give_the_reference_result(tmp_path):
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
    ]
    spec = (TensorProto.FLOAT, ["b", "n", 32])
    path = save_graph(tmp_path, nodes, {"q": spec, "k": spec}, {"s": TensorProto.FLOAT}, 17)
    shapes = {x: [(1, 1, 32), (4, 64, 32), (4, 64, 32)] for x in "qk"}
    rng = np.random.default_rng(0)
    with ek.build(path, backend="tvm", shapes=shapes, specialize=False) as engine:
        for batch, seq in ((1, 1), (2, 5), (4, 17), (4, 64)):
            feeds = {x: rng.standard_normal((batch, seq, 32)).astype(np.float32) for x in "qk"}
            got = engine.infer(feeds)["s"]
            np.testing.assert_allclose(got, reference(path, feeds)["s"], rtol=1e-5, atol=1e-5)


def test_a_softmax_over_a_symbolic_axis_is_computed_row_by_row_without_predicates():
    # DLight's rule split the symbolic row into predicated vectors (scalarized) and kept every
    # intermediate as a full-size tensor: a small BERT's dynamic softmax took 3x its static one.
    # The exponentials (summed, then divided) are computed once per row, not inlined twice.
    from tvm import te, tirx, topi

    n = tirx.Var("n", "int64")
    x = te.placeholder((64, n), "float32", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x)])
    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(func, 8).mod.script()
    assert "T.where" not in script and "in range(n)" in script and "T.parallel" in script
    assert "T_softmax_delta = " not in script  # the other intermediates inlined
    rows = script.index("T.parallel")
    exp = script.index('T.sblock("T_softmax_exp")', rows)
    total = script.index('T.sblock("T_softmax_expsum")', exp)
    assert script.index("T.reads(T_softmax_exp[", total) < script.index("T_softmax_norm[", total)


def test_a_softmax_over_a_symbolic_axis_reduces_in_vectors_at_every_length():
    # fastmath splits each row reduction into 16 running results (vectorized) and a scalar
    # tail; a TIR reduction's init runs in its first iteration, so rows shorter than 16 or
    # without a tail must still come out right (each reduction runs one identity step more).
    import tvm
    from tvm import te, tirx

    from enginekit.backends.tvm import fastmath, schedule

    n = tirx.Var("n", "int64")
    x = te.placeholder((3, 2, n), "float32", name="x")
    func = te.create_prim_func([x, fastmath._softmax(x, -1)])
    sch = schedule.schedule_cpu(func, 8)
    script = sch.mod.script()
    assert "T.vectorized(T.int64(16))" in script.split('T.sblock("T_softmax_maxelem_part")')[0]
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    for length in (1, 5, 16, 17, 40):
        xs = rng.uniform(-20, 20, (3, 2, length)).astype(np.float32)
        xs[0, 0, : length // 2] = -np.inf
        out = tvm.runtime.tensor(np.zeros_like(xs))
        lib(tvm.runtime.tensor(xs), out)
        want = np.exp(xs - xs.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-7)


def _project():
    """A projection ``[2, n, 256] @ [256, 256]`` with a constant weight, over a symbolic
    sequence ``n``."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def project(x_h: T.handle, w: T.Buffer((T.int64(256), T.int64(256)), "float32"), y_h: T.handle):
        T.func_attr({"layout_free_buffers": [1]})
        n = T.int64()
        x = T.match_buffer(x_h, (T.int64(2), n, T.int64(256)), "float32")
        y = T.match_buffer(y_h, (T.int64(2), n, T.int64(256)), "float32")
        for b, i, j, r in T.grid(T.int64(2), n, T.int64(256), T.int64(256)):
            with T.sblock("matmul"):
                vb, vi, vj, vr = T.axis.remap("SSSR", [b, i, j, r])
                with T.init():
                    y[vb, vi, vj] = T.float32(0)
                y[vb, vi, vj] = y[vb, vi, vj] + x[vb, vi, vr] * w[vr, vj]

    return project


def test_rows_that_are_a_sequence_within_a_batch_are_padded_without_a_run_time_choice():
    # A sequence's rows take the unpadded branch only at a length of 1 to 3, so a
    # transformer's projections are padded alone, packed.
    from enginekit.backends.tvm import packing, schedule

    sch = schedule.schedule_cpu(_project(), 8)
    script = sch.mod.script()
    assert "_pad_local" in script and "T.int64(4) <= n" not in script and "n >= T" not in script
    assert packing.PREPACK in script  # the weight is repacked
    # The padded rows are copied once, not selected inside the reduction loop.
    assert "x_pad = T.sblock_alloc_buffer" in script and "T.if_then_else(vi < n" not in script


def test_padded_sequence_rows_are_copied_a_row_block_per_parallel_task():
    # A pass of its own over the input before every projection: the small dynamic-only BERT
    # spent 7.8 ms of calling-thread CPU per inference at batch 16 on two threads (static 5.7).
    import tvm

    from enginekit.backends.tvm import schedule

    script = schedule.schedule_cpu(_project(), 8).mod.script()
    # One parallel loop (the row blocks); the copy of a block's rows is vectorized inside it,
    # before the serial loop over the channel tiles.
    assert script.count("T.parallel") == 1
    loop = script.index("T.parallel")
    copy, tiles = script.index('T.sblock("x_pad")'), script.index('T.sblock("matmul_init")')
    assert loop < copy < tiles and "T.vectorized(T.int64(16))" in script[loop:copy]
    func = schedule.schedule_cpu(_project(), 8).mod["main"].with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target={"kind": "llvm"})
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    for n in (1, 5, 8, 13):  # below, between and at multiples of the row block
        x = rng.standard_normal((2, n, 256)).astype(np.float32)
        y = tvm.runtime.tensor(np.zeros((2, n, 256), np.float32))
        lib(tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
        np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)


def test_a_matmul_over_a_symbolic_batch_keeps_its_padded_rows_in_a_pass_of_their_own():
    # Copied a row block per task, the row blocks would be the parallel loop and every
    # thread would stream the whole weight once per block; over a batch (a classifier) the
    # weight-bound tile order stays: channel tiles outermost, the padded rows copied first.
    from tvm.script import tirx as T

    from enginekit.backends.tvm import schedule

    @T.prim_func(private=True, s_tir=True)
    def dense(x_h: T.handle, w: T.Buffer((T.int64(256), T.int64(512)), "float32"), y_h: T.handle):
        T.func_attr({"layout_free_buffers": [1]})
        b = T.int64()
        x = T.match_buffer(x_h, (b, T.int64(256)), "float32")
        y = T.match_buffer(y_h, (b, T.int64(512)), "float32")
        for i, j, r in T.grid(b, T.int64(512), T.int64(256)):
            with T.sblock("matmul"):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + x[vi, vr] * w[vr, vj]

    script = schedule.schedule_cpu(dense, 16).mod.script()
    assert "ax1_0_ax0_0_fused in T.parallel((b + T.int64(7)) // T.int64(8) * T.int64(16))" in script
    assert "T.parallel((b + T.int64(7)) // T.int64(8))" not in script


def test_a_small_projection_over_batch_and_sequence_is_parallel_and_packed():
    # Below PARALLEL_WORK per row, a kernel over a symbolic extent gets a parallel and a
    # serial schedule chosen at run time (both read one packed weight: test_tvm_mobile.py);
    # over batch x sequence rows (a transformer's Q/K/V projections) it is one parallel
    # schedule, packed.
    from tvm.script import tirx as T

    from enginekit.backends.tvm import packing, schedule

    @T.prim_func(private=True, s_tir=True)
    def small(x_h: T.handle, w: T.Buffer((T.int64(64), T.int64(64)), "float32"), y_h: T.handle):
        T.func_attr({"layout_free_buffers": [1]})
        b, n = T.int64(), T.int64()
        x = T.match_buffer(x_h, (b, n, T.int64(64)), "float32")
        y = T.match_buffer(y_h, (b, n, T.int64(64)), "float32")
        for i0, i, j, r in T.grid(b, n, T.int64(64), T.int64(64)):
            with T.sblock("matmul"):
                vb, vi, vj, vr = T.axis.remap("SSSR", [i0, i, j, r])
                with T.init():
                    y[vb, vi, vj] = T.float32(0)
                y[vb, vi, vj] = y[vb, vi, vj] + x[vb, vi, vr] * w[vr, vj]

    script = schedule.schedule_cpu(small, 8).mod.script()
    assert "T.parallel" in script and packing.PREPACK in script
    assert "T.int64(65536)" not in script  # no run-time parallel / serial choice


def test_attention_softmax_keeps_its_query_loop_out_of_the_fused_parallel_loop():
    # Fused with the query loop, every block recovered its indices by symbolic divisions per
    # row (a small BERT's dynamic softmax at batch 16: a third of its time).
    import tvm
    from tvm import te, tirx

    from enginekit.backends.tvm import fastmath, schedule

    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    x = te.placeholder((b, tirx.const(2, "int64"), s, s), "float32", name="x")  # as Relax
    func = te.create_prim_func([x, fastmath._softmax(x, -1)])
    sch = schedule.schedule_cpu(func, 8)
    script = sch.mod.script()
    assert "T.parallel(b * T.int64(2))" in script and "// (s *" not in script
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm"}))
    xs = np.random.default_rng(0).standard_normal((3, 2, 19, 19)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros_like(xs))
    lib(tvm.runtime.tensor(xs), out)
    want = np.exp(xs - xs.max(-1, keepdims=True))
    np.testing.assert_allclose(
        out.numpy(), want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7
    )


def _stem(window: int, stride: int):
    """An NHWC conv over 3 input channels (a stem): ``(1, 32, 32, 3) -> (.., .., .., 32)``."""
    from tvm import te, topi

    x = te.placeholder((1, 32, 32, 3), "float32", name="x")
    w = te.placeholder((window, window, 3, 32), "float32", name="w")
    y = topi.nn.conv2d_nhwc(x, w, stride, window // 2, 1)
    return te.create_prim_func([x, w, y])


def test_a_seven_by_seven_stem_pads_its_input_in_a_pass_of_its_own():
    # Inlined, each of the 49 taps was a bounds check for 3 multiply-adds per output vector
    # (ResNet-50's stem alone, one thread: 0.46 -> 0.27 ms at batch 1); a 3x3 window keeps the
    # inlined checks (a 3x3 stride-2 stem measured slower with the pass).
    import tvm
    from tvm import topi  # noqa: F401  (registers the conv's compute)

    from enginekit.backends.tvm import schedule

    seven = schedule.schedule_cpu(_stem(7, 2), 16)
    three = schedule.schedule_cpu(_stem(3, 2), 16)
    assert 'T.sblock("pad_temp")' in seven.mod.script()
    assert 'T.sblock("pad_temp")' not in three.mod.script()
    lib = tvm.compile(seven.mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 32, 32, 3)).astype(np.float32)
    w = rng.standard_normal((7, 7, 3, 32)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((1, 16, 16, 32), np.float32))
    lib(tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    padded = np.pad(x, ((0, 0), (3, 3), (3, 3), (0, 0)))
    want = np.zeros((1, 16, 16, 32), np.float32)
    for i in range(7):
        for j in range(7):
            want += padded[:, i : i + 32 : 2, j : j + 32 : 2, :] @ w[i, j]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def _pointwise(cin: int, cout: int):
    """An NHWC 1x1 conv ``(1, 8, 8, cin) -> (1, 8, 8, cout)`` (MobileNetV3's projections)."""
    from tvm import te, topi

    x = te.placeholder((1, 8, 8, cin), "float32", name="x")
    w = te.placeholder((1, 1, cin, cout), "float32", name="w")
    y = topi.nn.conv2d_nhwc(x, w, 1, 0, 1)
    return te.create_prim_func([x, w, y])


@pytest.mark.parametrize(("cin", "cout", "steps"), [(72, 24, 3), (24, 88, 1)])
def test_channels_no_multiple_of_sixteen_get_half_vectors_on_avx512(cin, cout, steps):
    # 24 channels were one <24 x float> vector, 88 were vectors of 11 lanes (88 = 8 x 11):
    # LLVM splits both into a 512-bit and a partial vector. Whole 256-bit vectors instead,
    # 24 as three unrolled 8-lane steps (MobileNetV3, Zen 4, one thread, batch 16: 7.2 ->
    # 6.0 ms).
    import tvm

    from enginekit.backends.tvm import schedule

    sch = schedule.schedule_cpu(_pointwise(cin, cout), 16)
    vectors = re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", sch.mod.script())
    unrolled = re.findall(r"T\.unroll\((?:T\.int64\()?(\d+)", sch.mod.script())
    assert vectors and set(vectors) == {"8"}
    assert steps == 1 or str(steps) in unrolled
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, cin)).astype(np.float32)
    w = rng.standard_normal((1, 1, cin, cout)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((1, 8, 8, cout), np.float32))
    lib(tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), x @ w[0, 0], rtol=1e-4, atol=1e-4)


def test_avx2_vector_factors_are_unchanged_by_the_half_vectors():
    from enginekit.backends.tvm import simd

    assert [simd._vector_factor(c, 8) for c in (24, 72, 88)] == [8, 8, 8]
    assert [simd._vector_factor(c, 16) for c in (24, 72, 88, 40)] == [24, 24, 8, 8]
