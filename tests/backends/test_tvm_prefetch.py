"""Software prefetch of a register tile's epilogue reads (enginekit/backends/tvm/prefetch.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm_conv_case import conv_relu_reference, fuse, fused_conv_relu

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")


def _conv(add: bool):
    """A 3x3 NHWC conv (+ a second input as residual) + ReLU over a symbolic batch, lowered,
    scheduled and compiled the way a build does; (VM, weight)."""
    from tvm import relax, tirx

    w = (np.random.default_rng(0).standard_normal((3, 3, 32, 32)) * 0.1).astype("float32")
    batch = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((batch, 16, 16, 32), "float32"))
    r = relax.Var("r", relax.TensorType((batch, 16, 16, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1, data_layout="NHWC",
                                           kernel_layout="HWIO"))  # fmt: skip
            if add:
                y = bb.emit(relax.op.add(y, r))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(out)
    return _compile(bb.get()), w


def _compile(mod):
    """``mod`` (Relax) legalized, fused, scheduled and compiled the way a build does."""
    from enginekit.backends.tvm import lower

    fused, target = fuse(mod)
    scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    return lower.compile_module(scheduled, target)


@pytest.mark.parametrize("add", [True, False])
def test_a_conv_tiles_residual_is_prefetched_before_its_reduction_and_results_match(add):
    # The residual of conv + add is read in the tile's write-back, after its reduction: a
    # prefetch of its lines at the tile's start. Without an add the write-back reads only
    # the tile's registers: nothing to prefetch.
    import tvm
    from tvm import relax

    ex, w = _conv(add)
    assert ("@llvm.prefetch" in ex.mod.imports[0].inspect_source("ll")) == add
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        data = rng.standard_normal((batch, 16, 16, 32)).astype("float32")
        residual = rng.standard_normal((batch, 16, 16, 32)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(residual)).numpy()
        want = conv_relu_reference(data, w, residual if add else None)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _matmul():
    """``x @ w + r`` over a symbolic batch, x (batch, 16, 8), w (8, 64), compiled; (executable, w).

    Its tile's write-back sits in a bounds guard (``if tile < 2``) and TVM's CSE binds the
    residual's index inside it: the kernel of timm's MobileViT (``timm-mobilevit_xxs``) that
    failed, a 64 -> 64 linear + residual add in its transformer blocks, reduced."""
    from tvm import relax, tirx

    w = (np.random.default_rng(0).standard_normal((8, 64)) * 0.1).astype("float32")
    batch = tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((batch, 16, 8), "float32"))
    r = relax.Var("r", relax.TensorType((batch, 16, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            out = bb.emit_output(bb.emit(relax.op.add(y, r)))
        bb.emit_func_output(out)
    return _compile(bb.get()), w


def test_a_residual_index_bound_inside_a_guarded_write_back_is_substituted_not_referenced():
    # The prefetch, placed before the reduction, must not reference a value CSE binds inside
    # the write-back (at any depth): it substitutes the binding's value. Referencing it failed
    # the compile ("cse_v10 has been used before definition!"), as timm's MobileViT did.
    import tvm
    from tvm import relax

    ex, w = _matmul()
    assert "@llvm.prefetch" in ex.mod.imports[0].inspect_source("ll")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        data = rng.standard_normal((batch, 16, 8)).astype("float32")
        residual = rng.standard_normal((batch, 16, 64)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(residual)).numpy()
        np.testing.assert_allclose(got, data @ w + residual, rtol=1e-4, atol=1e-4)


def _conv_relu(channels: int, pixels: int):
    """A 3x3 NHWC conv + ReLU over a symbolic batch, ``channels`` in and out at ``pixels`` x
    ``pixels``, compiled the way a build does; (executable, weight)."""
    from tvm import relax, tirx

    from enginekit.backends.tvm import lower

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 3, channels, channels)) * 0.02).astype("float32")
    x = relax.Var("x", relax.TensorType((tirx.Var("batch", "int64"), pixels, pixels, channels),
                                        "float32"))  # fmt: skip
    fused, target = fused_conv_relu(x, w)
    scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    return lower.compile_module(scheduled, target), w


def _check_conv_relu(ex, w: np.ndarray, pixels: int, seed: int) -> None:
    """``ex`` (from :func:`_conv_relu`) matches the reference at batch 1 and 2."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(seed)
    for batch in (1, 2):
        data = rng.standard_normal((batch, pixels, pixels, w.shape[2])).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data)).numpy()
        np.testing.assert_allclose(got, conv_relu_reference(data, w), rtol=1e-4, atol=1e-4)


def test_a_weight_bound_convs_large_weight_stream_is_prefetched_ahead_and_results_match():
    # ResNet-50's last-stage 3x3 conv at 64x64 inputs: 2x2 pixels, 512 channels, a 9 MB
    # weight read once per call at batch 1 (from memory: it does not stay in cache between
    # calls). Its tile loop is marked and its reduction loop prefetches the packed weight
    # stream ahead. A conv whose weight fits a core's cache (32 channels) is not marked.

    from enginekit.backends.tvm import placement

    assert 3 * 3 * 512 * 512 >= placement.STREAM_WEIGHT > 3 * 3 * 32 * 32
    ex, w = _conv_relu(512, 2)
    assert "@llvm.prefetch" in ex.mod.imports[0].inspect_source("ll")
    small, _ = _conv_relu(32, 16)
    assert "@llvm.prefetch" not in small.mod.imports[0].inspect_source("ll")
    _check_conv_relu(ex, w, 2, seed=1)


def _stream_kernel(marked: bool):
    """A lowered tile kernel: a parallel loop (marked as streaming its weight, or not), a
    local tile, a reduction over ``k`` reading 32 contiguous weights per step, a write-back."""
    from tvm.script import tirx as T

    from enginekit.backends.tvm.prefetch import STREAM

    annotations = {STREAM: 1} if marked else {}

    @T.prim_func
    def tile(x: T.Buffer((256,), "float32"), w: T.Buffer((65536,), "float32"),
             y: T.Buffer((256,), "float32")):  # fmt: skip
        for t in T.parallel(8, annotations=annotations):
            acc = T.alloc_buffer((32,), "float32", scope="local")
            for j in range(32):
                acc[j] = T.float32(0)
            for k in range(256):
                acc[0:16] = (
                    acc[T.Ramp(0, 1, 16)]
                    + T.Broadcast(x[k], 16) * w[T.Ramp(t * 8192 + k * 32, 1, 16)]
                )
                acc[16:32] = (
                    acc[T.Ramp(16, 1, 16)]
                    + T.Broadcast(x[k], 16) * w[T.Ramp(t * 8192 + k * 32 + 16, 1, 16)]
                )
            for j in range(32):
                y[t * 32 + j] = acc[j]

    return tile


@pytest.mark.parametrize("marked", [True, False])
def test_a_marked_tile_loop_prefetches_its_contiguous_weight_stream_ahead_in_the_reduction(
    marked,
):
    # Two 16-lane loads per step, 32 floats (128 bytes) apart per k: one stream of two cache
    # lines per step, prefetched STREAM_AHEAD bytes ahead at the start of each step.
    import tvm

    from enginekit.backends.tvm import prefetch

    mod = prefetch.prefetch_streams(tvm.IRModule({"main": _stream_kernel(marked)}))
    text = mod["main"].script()
    assert prefetch.STREAM not in text  # the mark is consumed
    lines = text.splitlines()
    prefetches = [i for i, line in enumerate(lines) if "T.prefetch" in line]
    assert len(prefetches) == (2 if marked else 0)
    if marked:
        # inside the reduction loop over k, before its updates, STREAM_AHEAD bytes ahead
        reduction = next(i for i, line in enumerate(lines) if "for k in range(256)" in line)
        update = next(i for i, line in enumerate(lines) if "acc[0:16] =" in line)
        assert all(reduction < i < update for i in prefetches)
        ahead = prefetch.STREAM_AHEAD // 4
        assert f"w[t * 8192 + k * 32 + {ahead}]" in lines[prefetches[0]]
        assert f"w[t * 8192 + k * 32 + {ahead + 16}]" in lines[prefetches[1]]


@pytest.mark.parametrize("cache", [1 << 20, 256 << 10])
def test_a_models_weights_beyond_the_last_level_cache_lower_the_stream_threshold(
    monkeypatch, cache
):
    # A 3x3 conv, 128 channels over 4x4 pixels (ResNet-50's layer3 shape, halved): a 147K-
    # element weight (576 KiB), weight-bound at batch 1, under STREAM_WEIGHT. On a host whose
    # last-level cache holds the model's weights it is not marked (they stay cached between
    # calls); where they exceed it (a 256 KiB cache here, as ResNet-50's 102 MB exceed a 32
    # MiB L3) every weight comes from memory each call, and its stream is prefetched too.

    import enginekit.target
    from enginekit.backends.tvm import placement

    assert placement.STREAM_WEIGHT_EVICTED <= 3 * 3 * 128 * 128 < placement.STREAM_WEIGHT
    monkeypatch.setattr(enginekit.target, "cache_bytes", lambda: cache)
    ex, w = _conv_relu(128, 4)
    evicted = 3 * 3 * 128 * 128 * 4 > cache
    assert ("@llvm.prefetch" in ex.mod.imports[0].inspect_source("ll")) == evicted
    _check_conv_relu(ex, w, 4, seed=2)


def test_constant_bytes_counts_each_weight_once():
    # Two convs sharing one weight and a second weight of its own: 2 weights, counted once each.
    from tvm import relax, tirx

    from enginekit.backends.tvm import lower

    w = np.zeros((3, 3, 8, 8), "float32")
    v = np.zeros((1, 1, 8, 8), "float32")
    x = relax.Var("x", relax.TensorType((tirx.Var("batch", "int64"), 4, 4, 8), "float32"))
    bb = relax.BlockBuilder()
    shared = relax.const(w)
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = dict(data_layout="NHWC", kernel_layout="HWIO")
            y = bb.emit(relax.op.nn.conv2d(x, shared, padding=1, **conv))
            y = bb.emit(relax.op.nn.conv2d(y, shared, padding=1, **conv))
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(y, relax.const(v), **conv)))
        bb.emit_func_output(out)
    fused, _target = fuse(bb.get())
    assert lower.constant_bytes(fused) == w.nbytes + v.nbytes


def test_an_epilogue_read_at_a_vector_of_addresses_is_not_prefetched_and_compiles():
    # A tile whose write-back reads one value into every lane (``r[Broadcast(t, 16)]``), as
    # MetaSchedule's candidates can write: its index is a vector, with no line to prefetch.
    # Prefetching its address failed LLVM codegen ("Expected buffer index to be an integer"),
    # the random failure of the MetaSchedule-tuned build in test_tvm's tuning test.
    import tvm
    from tvm.script import tirx as T

    from enginekit.backends.tvm import prefetch

    @T.prim_func
    def tile(x: T.Buffer((32,), "float32"), r: T.Buffer((8,), "float32"),
             y: T.Buffer((128,), "float32")):  # fmt: skip
        T.func_attr({"global_symbol": "tile", "tirx.noalias": True})
        for t in T.parallel(8):
            acc = T.alloc_buffer((16,), "float32", scope="local")
            for j in range(16):
                acc[j] = T.float32(0)
            for k in range(4):
                acc[0:16] = acc[T.Ramp(0, 1, 16)] + T.Broadcast(x[t * 4 + k], 16)
            y[t * 16 : t * 16 + 16] = acc[T.Ramp(0, 1, 16)] + r[T.Broadcast(t, 16)]

    mod = prefetch.prefetch_epilogues(tvm.IRModule({"tile": tile}))
    assert "T.prefetch" not in mod["tile"].script()
    lib = tvm.compile(mod, target="llvm")
    x = np.arange(32, dtype="float32")
    r = np.arange(8, dtype="float32") * 100
    y = tvm.runtime.tensor(np.zeros(128, "float32"))
    lib["tile"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), y)
    want = np.repeat(x.reshape(8, 4).sum(1) + r, 16)
    np.testing.assert_allclose(y.numpy(), want)
