"""Software prefetch of a register tile's epilogue reads (enginekit/backends/tvm/prefetch.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm_conv_case import conv_relu_reference, fuse

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
