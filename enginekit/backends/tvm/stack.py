"""Register tiles as stack arrays: the TIR pipeline enginekit compiles CPU kernels with.

TVM 0.27's ``LowerTVMBuiltin`` allocates every CPU buffer of 1 KiB or more
(``kMaxStackAlloca``) with ``TVMBackendAllocWorkspace``: a call into the runtime's workspace
pool and one to free it, each time the allocation is reached. A register tile's accumulators
(``cache_write`` to ``local`` in :mod:`.reduction`) are allocated per tile, inside the
parallel loop, and AVX-512's 8 x 32 float tile is exactly 1 KiB: every tile of every such
conv paid the two calls, and its accumulators lived behind a heap pointer that LLVM keeps in
registers only where it can hoist their loads and stores out of the reduction loop (it could
not in a conv over a static batch, or a 3x3 32 -> 32 conv over a symbolic one alone:
56 GF/s). Annotated ``disable_lower_builtin``, such a buffer stays an ``alloca``: on the stack,
and promoted to registers.

Only ``local`` buffers of at most :data:`STACK_BYTES` with a static size are annotated
(what a register tile can be: AVX-512's 32 vector registers hold 2 KiB); larger ones (rows
copied per task) keep the workspace pool.
"""

from __future__ import annotations

from typing import Any

#: Largest ``local`` buffer kept on the stack: AVX-512's 32 registers of 64 bytes.
STACK_BYTES = 2048

#: The name the pipeline is registered under in TVM's TIR pipeline map.
PIPELINE = "enginekit_cpu"


def _bytes(buffer: Any) -> int | None:
    """Bytes of a buffer of static shape, None for a symbolic one."""
    import tvm
    from tvm import tirx

    dtype = tvm.DataType(buffer.dtype)
    size = dtype.bits * dtype.lanes // 8
    for dim in buffer.shape:
        if not isinstance(dim, tirx.IntImm):
            return None
        size *= int(dim)
    return size


def _on_stack(stmt: Any) -> Any:
    """``stmt`` (an ``AllocBuffer``) annotated to stay a stack array where it is a tile."""
    from tvm import tirx

    buffer = stmt.buffer
    size = _bytes(buffer)
    if size is None or size > STACK_BYTES or buffer.scope() != "local":
        return stmt
    annotations = dict(stmt.annotations or {})
    annotations["disable_lower_builtin"] = tirx.const(True, "bool")
    return tirx.AllocBuffer(buffer, annotations=annotations)


def stack_tiles(mod: Any) -> Any:
    """``mod`` with its register tiles' allocations annotated to stay on the stack."""
    import tvm_ffi
    from tvm import tirx

    return tvm_ffi.structural_map(mod, ((tirx.AllocBuffer, _on_stack),))


def pipeline() -> str:
    """The name of TVM's default TIR pipeline followed by
    :func:`.prefetch.prefetch_epilogues`, :func:`.prefetch.prefetch_streams` and
    :func:`stack_tiles` (registered on first use), for ``tvm.compile(..., tir_pipeline=...)``
    on CPU targets."""
    import tvm
    from tvm.tirx import compilation_pipeline

    from enginekit.backends.tvm.prefetch import prefetch_epilogues, prefetch_streams

    if PIPELINE not in compilation_pipeline.PIPELINE_MAP:

        def factory() -> tuple[Any, Any, Any]:
            lower, host, device = compilation_pipeline.get_tir_pipeline("s_tir")
            tiles = tvm.transform.module_pass(
                lambda mod, _ctx: stack_tiles(prefetch_streams(prefetch_epilogues(mod))),
                opt_level=0,
                name="StackTilesPrefetch",
            )
            return tvm.transform.Sequential([lower, tiles]), host, device

        compilation_pipeline.PIPELINE_MAP[PIPELINE] = factory
    return PIPELINE
