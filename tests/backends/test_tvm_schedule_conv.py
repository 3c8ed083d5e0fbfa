"""enginekit's TVM CPU schedules of regular convolutions (enginekit/backends/tvm/schedule.py):
where the output-channel tiles of a weight-bound conv go in the parallel loop, and the
numerics of the schedules at odd channel counts, on both ISAs' vector widths."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tvm_conv_case import conv_relu_reference, fused_conv_relu

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

#: Vector lanes of AVX2 (8 float32) and AVX-512 (16): the schedules differ between them.
LANES = (8, 16)


def _conv(batch: int | None, pixels: int, cin: int, cout: int):
    """A 3x3 NHWC/HWIO conv with padding 1 and a ReLU, ``(batch, pixels, pixels, cin)``
    (``batch=None``: symbolic)."""
    from tvm import te, topi

    n = te.var("batch", "int64") if batch is None else batch
    x = te.placeholder((n, pixels, pixels, cin), "float32", name="x")
    w = te.placeholder((3, 3, cin, cout), "float32", name="w")
    return te.create_prim_func([x, w, topi.nn.relu(topi.nn.conv2d_nhwc(x, w, 1, 1, 1))])


def _parallel(script: str) -> str:
    (loop,) = re.findall(r"for (\w+) in T\.parallel", script)
    return loop


@pytest.mark.parametrize("lanes", LANES)
def test_a_conv_with_a_large_weight_puts_its_channel_tiles_outside_the_batch(lanes):
    # ResNet-50's last-stage 3x3 convs (2x2 pixels, 512 channels: 2.4M weights, 9 MB) had
    # their channel tiles right after the batch: each image streamed the whole weight again
    # (batch 16, one thread: 45-63 GF/s; outside the batch 55-76 GF/s).
    from enginekit.backends.tvm import placement, schedule

    # Loops as normalized: ax0 the batch (2: no weight dim is 2 long), ax1/ax2 rows and
    # columns (the columns are the register block), ax3_0 the channel tiles.
    large = schedule.schedule_cpu(_conv(2, 2, 300, 1000), lanes).mod.script()
    assert 3 * 3 * 300 * 1000 > placement.LARGE_WEIGHT
    assert _parallel(large).startswith("ax3_0_ax0")
    # A weight-bound conv with a weight that stays in cache keeps them after the batch
    # (MobileNetV3's late convs measured 1.2-1.8x slower with them outermost at batch 16).
    small = schedule.schedule_cpu(_conv(2, 2, 40, 96), lanes).mod.script()
    assert _parallel(small).startswith("ax0_ax3_0")


@pytest.mark.parametrize("lanes", LANES)
def test_a_window_conv_streaming_a_large_weight_blocks_its_short_rows_pixels_in_one_tile(lanes):
    # ResNet-50's last-stage 3x3 convs at 64x64 inputs (2x2 pixels, 512 channels, 9 MB of
    # weight): a tile of one row's 2 pixels read each weight strip once per row; the 4
    # pixels in one tile read it once, and the tile loop is marked for the weight-stream
    # prefetch. A conv whose weight stays in cache keeps its column block.
    from enginekit.backends.tvm import prefetch, schedule

    large = schedule.schedule_cpu(_conv(2, 2, 512, 512), lanes).mod.script()
    assert re.search(r"for ax1_ax2_fused in T\.unroll\(4\)", large)
    assert prefetch.STREAM in large
    small = schedule.schedule_cpu(_conv(2, 2, 40, 96), lanes).mod.script()
    assert "ax1_ax2_fused" not in small and prefetch.STREAM not in small


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize(
    ("batch", "pixels", "cin", "cout"), [(2, 2, 300, 1000), (5, 3, 37, 24), (1, 8, 19, 32)]
)
def test_conv_schedules_give_the_reference_result(lanes, batch, pixels, cin, cout):
    import tvm

    from enginekit.backends.tvm import schedule

    sch = schedule.schedule_cpu(_conv(batch, pixels, cin, cout), lanes)
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, pixels, pixels, cin)).astype(np.float32)
    w = rng.standard_normal((3, 3, cin, cout)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((batch, pixels, pixels, cout), np.float32))
    lib(tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))
    want = np.maximum(np.einsum("nhwcij,ijco->nhwo", windows, w), 0)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-3)


def test_a_large_conv_weight_over_a_symbolic_batch_is_packed_and_gives_the_reference_result():
    # The model's path: a symbolic batch, the constant weight repacked at build time.
    import tvm
    from tvm import relax, tirx

    from enginekit.backends.tvm import lower

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((3, 3, 300, 1000)) * 0.05).astype("float32")
    x = relax.Var("x", relax.TensorType((tirx.Var("batch", "int64"), 2, 2, 300), "float32"))
    fused, target = fused_conv_relu(x, w)
    scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    kernel = next(f for gv, f in scheduled.functions_items() if gv.name_hint.endswith("prepacked"))
    assert _parallel(kernel.script()).startswith("ax3_0_ax0")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=target), tvm.cpu())
    for batch in (1, 3):
        data = rng.standard_normal((batch, 2, 2, 300)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data)).numpy()
        want = conv_relu_reference(data, w)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def _tile(script: str) -> tuple[int, int]:
    """(rows, lanes) of the register tile's update: its unrolled and vectorized loops."""
    update = script[script.index('T.sblock("conv2d_nhwc_update")') - 400 :]
    rows = re.findall(r"T\.unroll\((?:T\.int64\()?(\d+)", update)[0]
    lanes = re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", update)[0]
    return int(rows), int(lanes)


def test_a_static_window_conv_keeps_its_accumulators_under_a_kibibyte():
    # AVX-512's 8 x 32 tile is exactly 1 KiB: TVM put it in a workspace buffer, and with the
    # padding checks' branches every reduction step stored it (a static-batch demo CNN ran
    # 2.35x slower than built with a symbolic batch). 4 rows x 32 fit a stack array.
    from enginekit.backends.tvm import schedule, simd

    rows, lanes = _tile(schedule.schedule_cpu(_conv(1, 8, 32, 32), 16).mod.script())
    assert (rows, lanes) == (4, 32) and rows * lanes < simd.STACK_FLOATS
    # Over a symbolic batch the stores were hoisted: 8 rows measured 8% faster at batch 1.
    assert _tile(schedule.schedule_cpu(_conv(None, 8, 32, 32), 16).mod.script()) == (8, 32)
    # AVX2's 4 x 16 tile was under the limit already.
    assert _tile(schedule.schedule_cpu(_conv(1, 8, 32, 32), 8).mod.script()) == (4, 16)


def _streaming_kernel(monkeypatch, cin: int, cout: int, evicted: bool):
    """The scheduled kernel (its script) and module of a 3x3 conv + ReLU over 4x4 pixels with
    a constant weight, scheduled as in a build on an AVX-512 host whose last-level cache is
    smaller than the weight (``evicted``: every weight streams from memory) or larger."""
    from tvm import relax, tirx

    import enginekit.target
    from enginekit.backends.tvm import lower, schedule

    monkeypatch.setattr(enginekit.target, "cache_bytes", lambda: 1 << (16 if evicted else 30))
    monkeypatch.setattr(schedule, "vector_lanes", lambda target, dtype_bits=32: 16)
    w = (np.random.default_rng(4).standard_normal((3, 3, cin, cout)) * 0.05).astype("float32")
    x = relax.Var("x", relax.TensorType((tirx.Var("batch", "int64"), 4, 4, cin), "float32"))
    fused, target = fused_conv_relu(x, w)
    scheduled, _ = lower.apply_schedules(fused, target, "enginekit")
    kernel = next(f for gv, f in scheduled.functions_items() if gv.name_hint.endswith("prepacked"))
    return kernel.script(), scheduled, target, w


def test_a_weight_streaming_conv_over_16_pixels_reads_each_weight_once_unless_its_rows_alias(
    monkeypatch,
):
    # ResNet-50's layer3 at 64x64 inputs: 4x4 = 16 pixels. In two tiles of 8 rows each thread
    # read its weight strip twice, from memory, then from L2, without overlap; one tile of 16
    # rows x 1 vector reads each weight vector once (layer3 0.94 against 1.05 ms). Where the
    # 16 pixels' activation lines are 4 KiB apart (1024 channels) they share one L1 set and
    # the two 8-row tiles stay; where the weights stay in cache, the 4 x 2 row tiles. (AVX2's
    # 16 registers hold no 16-row tile: it keeps its own.)
    import tvm
    from tvm import relax

    script, scheduled, target, w = _streaming_kernel(monkeypatch, 256, 256, evicted=True)
    assert _tile(script) == (16, 16)
    assert _tile(_streaming_kernel(monkeypatch, 256, 256, evicted=False)[0]) == (4, 32)
    assert _tile(_streaming_kernel(monkeypatch, 1024, 64, evicted=True)[0]) == (8, 32)
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=target), tvm.cpu())
    rng = np.random.default_rng(5)
    for batch in (1, 2):
        data = rng.standard_normal((batch, 4, 4, 256)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(data)).numpy()
        np.testing.assert_allclose(got, conv_relu_reference(data, w), rtol=1e-4, atol=1e-3)


def _max_pool(batch: int | None, pixels: int, channels: int):
    """ResNet's 3x3 stride-2 max pool with padding 1, NHWC (``batch=None``: symbolic)."""
    from tvm import te, topi

    n = te.var("batch", "int64") if batch is None else batch
    x = te.placeholder((n, pixels, pixels, channels), "float32", name="x")
    y = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "max", layout="NHWC")
    return te.create_prim_func([x, y])


@pytest.mark.parametrize("lanes", LANES)
def test_a_max_pool_over_a_symbolic_batch_gives_the_reference_result(lanes):
    # Its padding is -inf, read through the inlined bounds checks of the register tile.
    import tvm

    from enginekit.backends.tvm import schedule

    sch = schedule.schedule_cpu(_max_pool(None, 32, 64), lanes)
    assert "T.parallel" in sch.mod.script() and "T.vectorized" in sch.mod.script()
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 32, 32, 64)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((batch, 16, 16, 64), np.float32))
        lib(tvm.runtime.tensor(x), out)
        padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(1, 2))
        want = windows[:, ::2, ::2].max(axis=(-2, -1))
        np.testing.assert_array_equal(out.numpy(), want)
