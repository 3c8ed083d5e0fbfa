"""Per-kernel times of a TVM engine, from the Relax VM's call instrument.

TVM 0.27's Relax VM has no profiling mode of its own (``VirtualMachine(..., profile=True)``
went); what it keeps is ``set_instrument``: a callback before and after every call
instruction. Each compiled kernel call (``fused_conv2d_add_relu``, ``matmul``, ``transpose``)
is timed between the two; the VM's own builtins (``vm.builtin.alloc_tensor``, ``match_shape``)
are left out of the table — their cost shows as the difference between op time and infer time.

The kernels run in destination-passing style: their last tensor argument is the output, so
FLOPs come from the argument shapes (a convolution's weight is its second argument, in the
layout the build chose — OIHW, OHWI or HWIO).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.backends.profiling import OpEvent, conv_flops, matmul_flops

if TYPE_CHECKING:
    from enginekit.backends.tvm.runtime import TvmEngine

#: Call symbols of the VM's own bookkeeping, not kernels of the model.
_BUILTIN = "vm.builtin."


def kernel_flops(symbol: str, shapes: Sequence[tuple[int, ...]]) -> float | None:
    """FLOPs of one kernel call from its name and argument shapes (output last), for
    convolutions and matrix products (None for other kernels or unreadable shapes)."""
    if len(shapes) < 3:
        return None
    out, first, weight = shapes[-1], shapes[0], shapes[1]
    if "conv2d" in symbol and len(weight) == 5:
        # Repacked by the schedule (HWIO in tiles of output channels: O/t, H, W, I, t).
        weight = (*weight[1:4], weight[0] * weight[4])
    if "conv2d" in symbol and len(weight) == 4 and len(out) == 4:
        # Output channels sit at out[1] (NCHW) or out[-1] (NHWC); the weight holds them at its
        # first (OIHW, OHWI) or last (HWIO) dim: divide them out to get the per-output MACs.
        channels = {out[1], out[-1]}
        if weight[0] in channels:
            return conv_flops(out, weight)
        if weight[-1] in channels:
            return conv_flops(out, (weight[-1], *weight[:-1]))
        return None
    if "matmul" in symbol or "dense" in symbol:
        return matmul_flops(out, int(first[-1])) if first else None
    return None


def _shapes(args: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in a.shape) for a in args if hasattr(a, "shape")]


def profile(
    engine: TvmEngine, feeds: Mapping[str, np.ndarray], runs: int, warmup: int
) -> list[OpEvent]:
    """Per-kernel times of ``engine`` on ``feeds``: ``warmup`` unrecorded runs, then ``runs``
    recorded ones, each kernel call timed by the VM's call instrument (on a VM of its own)."""
    from tvm import relax

    lib = engine.library(feeds)  # the module infer would use
    vm = relax.VirtualMachine(lib, engine._dev)
    args = [engine._to_tvm(np.asarray(feeds[n])) for n in engine.program_inputs]
    return profile_vm(vm, args, runs, warmup)


def profile_vm(vm: Any, args: Sequence[Any], runs: int, warmup: int) -> list[OpEvent]:
    """Per-kernel times of a Relax VM's ``main`` on ``args`` (TVM tensors), as :func:`profile`
    (the VM's call instrument is set to this function's timer and left there)."""
    from tvm.runtime.vm import VMInstrumentReturnKind

    events: list[OpEvent] = []
    state: dict[str, Any] = {"run": -1, "origin": 0.0, "open": {}}
    no_op = int(VMInstrumentReturnKind.NO_OP)

    def instrument(func: Any, symbol: str, before: bool, ret: Any, *call_args: Any) -> int:
        now = time.perf_counter()
        run = state["run"]
        if run < 0 or symbol.startswith(_BUILTIN):
            return no_op
        if before:
            state["open"][symbol] = now
            return no_op
        start = state["open"].pop(symbol, now)
        events.append(
            OpEvent(
                name=symbol,
                op=_op_type(symbol),
                kernel=symbol,
                run=run,
                dur_us=(now - start) * 1e6,
                start_us=(start - state["origin"]) * 1e6,
                flops=kernel_flops(symbol, _shapes(call_args)),
            )
        )
        return no_op

    vm.set_instrument(instrument)
    main = vm["main"]
    for _ in range(warmup):
        main(*args)
    state["origin"] = time.perf_counter()
    for run in range(runs):
        state["run"] = run
        main(*args)
    state["run"] = -1
    return events


def _op_type(symbol: str) -> str:
    """The op a kernel computes, from its name: ``fused_conv2d_add_relu`` -> ``conv2d``,
    ``transpose1`` -> ``transpose`` (TVM numbers repeated kernel names)."""
    head = symbol.removeprefix("fused_").split("_")[0]
    return head.rstrip("0123456789") or symbol
