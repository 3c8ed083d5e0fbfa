"""bf16 on TVM: convolutions and matrix products read bfloat16 operands and accumulate in
float32; everything else (norms, softmax, activations) stays float32.

Only for LLVM targets with AVX512-BF16 (``avx512bf16`` among the target's features: Zen 4,
Cooper Lake, Sapphire Rapids and later): there LLVM converts float32 <-> bfloat16 in one
instruction. Elsewhere bf16 would be emulated with integer shifts, slower than float32 and
no more accurate, so it is refused. The weights are cast at build time (constant folding);
activations are cast where they enter a conv or matmul. Verification against ONNX Runtime's
float32 output at the bf16 tolerance gates the build, as for every precision.
"""

from __future__ import annotations

from typing import Any

from enginekit.errors import BuildError

#: The LLVM feature that makes bf16 conversions native.
FEATURE = "avx512bf16"
#: Ops whose float32 operands are cast to bfloat16 (output stays float32).
CAST_OPS = ("relax.nn.conv2d", "relax.matmul")


def check_target(target: Any, device: str) -> None:
    """Refuse bf16 where the target cannot convert to bfloat16 natively.

    Raises:
        BuildError: a CUDA target, or an LLVM target without AVX512-BF16 (this host's, or the
            one asked for), naming what was found and what to do.
    """
    from tvm.target import codegen

    if target.kind.name != "llvm":
        raise BuildError(
            f"precision bf16 on the tvm backend is built for CPU (llvm) targets; got "
            f"{target.kind.name}. Use precision='fp32', or the onnxruntime backend on CUDA"
        )
    try:
        features = {str(f) for f in codegen.llvm_get_cpu_features(target)}
    except Exception:  # a target LLVM cannot describe
        features = set()
    if FEATURE not in features:
        mcpu = str(target.attrs.get("mcpu", "") or "generic")
        raise BuildError(
            f"precision bf16 on the tvm backend needs a CPU with AVX512-BF16 (LLVM feature "
            f"{FEATURE!r}); the target's CPU {mcpu!r} has none, so bf16 would be emulated and "
            "run slower than fp32. Build fp32 here, or cross-compile for a bf16 CPU with "
            "target={'kind': 'llvm', 'mcpu': 'znver4'} (or sapphirerapids)"
        )


def to_bf16(mod: Any) -> Any:
    """``mod`` with every float32 conv2d and matmul computing on bfloat16 operands.

    Run after the layout pass (a cast between a conv and its neighbours would stop
    ConvertLayout) and before constant folding (so constant weights are stored as bf16).
    """
    import tvm
    from tvm import relax

    bf16 = "bfloat16"

    @relax.expr_functor.mutator
    class Cast(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name in CAST_OPS):
                return call
            dtypes = [getattr(getattr(a, "ty", None), "dtype", None) for a in call.args[:2]]
            if dtypes != ["float32", "float32"]:
                return call
            a, b = (relax.op.astype(x, bf16) for x in call.args[:2])
            if call.op.name == "relax.matmul":
                return relax.op.matmul(a, b, out_dtype="float32")
            at = call.attrs
            return relax.op.nn.conv2d(
                a,
                b,
                strides=at.strides,
                padding=at.padding,
                dilation=at.dilation,
                groups=at.groups,
                data_layout=at.data_layout,
                kernel_layout=at.kernel_layout,
                out_layout=at.out_layout,
                out_dtype="float32",
            )

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = Cast().visit_expr(func)
    return mod


def count_casts(graph: Any) -> int:
    """How many conv2d/matmul calls of ``graph`` read bfloat16 operands (for the manifest)."""
    import tvm
    from tvm import relax

    found = 0

    def visit(expr: Any) -> None:
        nonlocal found
        if (
            isinstance(expr, relax.Call)
            and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name in CAST_OPS
            and getattr(getattr(expr.args[0], "ty", None), "dtype", None) == "bfloat16"
        ):
            found += 1

    for _, func in graph.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return found
