"""Relax -> compiled library: target, layout, fusion, schedules, and what the program became.

The pipeline (one place, so tuning extracts its tasks from exactly the kernels it compiles):

1. ``DecomposeOpsForInference`` (batch norm -> scale/shift), ``CanonicalizeBindings``;
2. ``ConvertLayout`` to NHWC activations / HWIO weights for conv2d when ``layout="NHWC"``
   (TVM pushes the layout through elementwise ops and pooling, so transposes stay at the
   model's edges; ops it fails on are kept NCHW one by one, :mod:`.layout`), then ``FoldConstant`` (weight transposes and BN folding done at build time);
3. ``LegalizeOps`` + ``AnnotateTIROpPattern`` + ``FoldConstant`` + ``FuseOps`` + ``FuseTIR``
   (conv + bias + BN + activation, matmul + bias become one kernel);
4. tuned schedules from a MetaSchedule database, if any, then enginekit's CPU rules
   (:mod:`.schedule`) or DLight's GPU rules for every kernel left;
5. ``tvm.compile`` to a Relax VM executable (on CPU with register tiles kept on the stack,
   :mod:`.stack`, and their epilogue reads and marked weight streams prefetched,
   :mod:`.prefetch`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from enginekit.backends.tvm.messages import error_line
from enginekit.errors import BuildError

log = logging.getLogger(__name__)

LAYOUTS = ("NHWC", "NCHW")
SCHEDULES = ("enginekit", "dlight", "none")

#: LLVM feature name -> /proc/cpuinfo flag (the names enginekit.target compares).
_LLVM_TO_CPUINFO = {
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma",
    "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512cd": "avx512cd",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni",
    "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16", "neon": "asimd",
    "sve": "sve", "sve2": "sve2", "i8mm": "i8mm", "bf16": "bf16",
}  # fmt: skip


# -- target ------------------------------------------------------------------------------------


def host_target() -> dict[str, Any]:
    """The LLVM target of this host: its CPU detected (``mcpu="native"`` would be generic)."""
    from tvm.target import codegen

    return {
        "kind": "llvm",
        "mcpu": str(codegen.llvm_get_system_cpu()),
        "num-cores": os.cpu_count() or 1,
    }


def _parse_target_text(text: str) -> dict[str, Any]:
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BuildError(f"target {text!r} is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise BuildError(f"target {text!r}: expected a JSON object")
        return value
    kind, *flags = text.split()
    spec: dict[str, Any] = {"kind": kind}
    for flag in flags:
        key, sep, value = flag.lstrip("-").partition("=")
        if not sep:
            raise BuildError(f"target {text!r}: flag {flag!r} is not -key=value")
        spec[key] = value.split(",") if key in ("mattr", "keys", "libs") else value
    return spec


def resolve_target(option: Any, device: str) -> Any:
    """A ``tvm.target.Target`` from the ``target`` option, or this host's default.

    Accepted: None (this host: LLVM with its CPU, or CUDA for a cuda device), a dict in TVM's
    JSON form, a JSON string, ``"llvm"`` (generic x86-64/AArch64 code, portable), or the old
    text form ``"llvm -mcpu=skylake-avx512"`` (TVM 0.27 rejects text; it is converted here).

    Raises:
        BuildError: an unknown kind, an mcpu LLVM does not know, or a device mismatch.
    """
    import tvm
    from tvm.target import codegen

    if option is None:
        if device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            dev = tvm.cuda(index)
            if not dev.exist:
                raise BuildError(f"device {device!r}: no CUDA GPU visible to TVM here")
            return tvm.target.Target.from_device(dev)
        spec: dict[str, Any] = host_target()
    elif isinstance(option, tvm.target.Target):
        return option
    elif isinstance(option, Mapping):
        spec = dict(option)
    elif isinstance(option, str):
        spec = _parse_target_text(option)
    else:
        raise BuildError(f"target {option!r}: expected a dict, a JSON string or 'llvm'/'cuda'")
    kind = spec.get("kind")
    if kind not in ("llvm", "cuda"):
        raise BuildError(
            f"target kind {kind!r}: the tvm backend builds for 'llvm' (CPU) or 'cuda' targets"
        )
    if kind == "llvm" and "num-cores" not in spec and "mtriple" not in spec:
        spec["num-cores"] = os.cpu_count() or 1  # MetaSchedule needs it; harmless otherwise
    try:
        target = tvm.target.Target(spec)
    except Exception as exc:
        raise BuildError(f"target {spec}: TVM rejects it ({str(exc).splitlines()[0]})") from None
    mcpu = spec.get("mcpu")
    if kind == "llvm" and mcpu:
        known = [str(c) for c in codegen.llvm_get_cpu_archlist(target) or ()]
        if known and mcpu not in known:
            near = [c for c in known if c.startswith(str(mcpu)[:3])][:8]
            raise BuildError(
                f"target mcpu {mcpu!r} is not a CPU LLVM knows"
                + (f" (close: {', '.join(near)})" if near else "")
                + "; omit target to build for this host"
            )
    return target


def target_requirements(target: Any) -> dict[str, Any]:
    """What running code for ``target`` needs from a host, in enginekit.target's terms."""
    from tvm.target import codegen

    if target.kind.name == "cuda":
        arch = str(target.attrs.get("arch", ""))
        return {"kind": "cuda", "arch": arch, "compute_capability": _sm_to_cc(arch)}
    try:
        features = {str(f) for f in codegen.llvm_get_cpu_features(target)}
    except Exception:
        features = set()
    requires = sorted({_LLVM_TO_CPUINFO[f] for f in features if f in _LLVM_TO_CPUINFO})
    out: dict[str, Any] = {"kind": "cpu", "requires": requires}
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple:
        out["machine"] = triple.split("-")[0]
    return out


def _sm_to_cc(arch: str) -> str:
    digits = re.sub(r"\D", "", arch)
    return f"{digits[:-1]}.{digits[-1]}" if len(digits) >= 2 else ""


def describe_target(target: Any) -> dict[str, Any]:
    """The target as TVM's JSON dict (what the manifest records)."""
    return {str(k): _jsonable(v) for k, v in dict(target.export()).items() if k != "host"}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":
        return [_jsonable(v) for v in value]
    return str(value)


# -- Relax passes -------------------------------------------------------------------------------


def _has_conv2d(mod: Any) -> bool:
    from tvm import relax

    return any(
        getattr(call.op, "name", None) == "relax.nn.conv2d"
        for _, func in mod.functions_items()
        if isinstance(func, relax.Function)
        for call in _calls(func)
    )


_BINARY = frozenset(
    f"relax.{op}"
    for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "where")
)


def full_rank_constants(mod: Any) -> Any:
    """Constants broadcast against a higher-rank tensor get that rank (leading 1s).

    A per-channel constant of shape ``(C, 1, 1)`` (batch norm unfolded after a concat, as
    ONNX exports of DenseNet have) cannot be relaid by ConvertLayout, which then transposes
    back to NCHW around it (517 transposes in DenseNet-121); ``(1, C, 1, 1)`` converts.
    """
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class FullRank(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name in _BINARY):
                return call
            known = [
                isinstance(getattr(a, "ty", None), relax.TensorType) and a.ty.shape is not None
                for a in call.args
            ]
            if not all(known):
                return call
            ranks: list[int] = [len(a.ty.shape) for a in call.args]
            top = max(ranks)
            args = []
            for arg, rank in zip(call.args, ranks):
                if isinstance(arg, tvm.ir.GenericConst) and 0 < rank < top:
                    value = arg.value.numpy()
                    arg = relax.const(value.reshape((1,) * (top - rank) + value.shape), value.dtype)
                args.append(arg)
            if all(a.same_as(b) for a, b in zip(args, call.args)):
                return call
            return relax.Call(call.op, args, call.attrs, call.ty_args)

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = FullRank().visit_expr(func)
    return mod


def optimize(
    mod: Any, target: Any, layout: str, precision: str = "fp32"
) -> tuple[Any, Any, list[Any]]:
    """Steps 1-3 of the module docstring: layout, (bf16 casts,) folding, legalization, fusion.

    Returns:
        (the optimized Relax graph before lowering, the fused module with TIR kernels, the
        :class:`~enginekit.backends.tvm.layout.Barrier` ops kept in NCHW).

    Raises:
        BuildError: TVM's layout conversion failed on this graph even op by op.
    """
    import tvm
    from tvm import relax

    from enginekit.backends.tvm.fastmath import fast_math
    from enginekit.backends.tvm.layout import convert_nhwc
    from enginekit.backends.tvm.reshape import legalize_reshape

    barriers: list[Any] = []
    with target:
        mod = tvm.transform.Sequential(
            [relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings()]
        )(mod)
        # ConvertLayout only touches conv2d (and what it pushes the layout through); it is
        # skipped without one, since TVM 0.27's pass dies (std::bad_alloc) on some
        # symbolic-shape graphs such as a transformer layer exported from PyTorch.
        if layout == "NHWC" and _has_conv2d(mod):
            mod, barriers = convert_nhwc(full_rank_constants(mod))
        if precision == "bf16":
            from enginekit.backends.tvm.precision import to_bf16

            mod = to_bf16(mod)
        if target.kind.name == "llvm":
            # libm's erf per element, unvectorized, cost GELU more than its matmul.
            mod = fast_math(mod)
        graph = tvm.transform.Sequential(
            [relax.transform.FoldConstant(), relax.transform.CanonicalizeBindings()]
        )(mod)
        fused = tvm.transform.Sequential(
            [
                # Reshapes over a symbolic dim by dim groups: injective, so they fuse.
                relax.transform.LegalizeOps({"relax.reshape": legalize_reshape}),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(graph)
    return graph, fused, barriers


def constant_bytes(mod: Any) -> int:
    """Bytes of the distinct constants the module's Relax functions use (its weights)."""
    import tvm
    from tvm import relax

    seen: dict[Any, int] = {}  # by node: one weight used by several calls counts once

    @relax.expr_functor.visitor
    class Constants(relax.PyExprVisitor):
        def visit_call_(self, call: Any) -> None:
            super().visit_call_(call)
            for arg in call.args:
                fields = arg.fields if isinstance(arg, relax.Tuple) else [arg]
                for a in fields:
                    if isinstance(a, tvm.ir.GenericConst) and a not in seen:
                        data = a.value
                        bits = tvm.runtime.DataType(str(data.dtype)).bits
                        seen[a] = math.prod(int(d) for d in data.shape) * bits // 8

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            Constants().visit_expr(func)
    return sum(seen.values())


def mark_layout_free(mod: Any) -> Any:
    """Mark each kernel's inputs that every call passes a constant (weights) as
    ``layout_free_buffers``, the attribute the CPU rule reads before repacking a weight.

    TVM's ``AttachAttrLayoutFreeBuffers`` does the same but copies every kernel it marks under
    a new name (``fused_conv2d1`` became ``fused_conv2d11``), which the manifest's and the
    profiler's kernel names would no longer match; this marks the kernels in place, and only
    where all of a kernel's calls agree.
    """
    import tvm
    from tvm import relax, tirx

    call_tir = tvm.ir.Op.get("relax.call_tir")
    constant: dict[str, list[bool]] = {}

    @relax.expr_functor.visitor
    class Calls(relax.PyExprVisitor):
        def visit_call_(self, call: Any) -> None:
            super().visit_call_(call)
            if not (call.op.same_as(call_tir) and isinstance(call.args[1], relax.Tuple)):
                return
            flags = [isinstance(a, tvm.ir.GenericConst) for a in call.args[1].fields]
            name = call.args[0].name_hint
            seen = constant.setdefault(name, flags)
            constant[name] = [a and b for a, b in zip(seen, flags)]

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            Calls().visit_expr(func)
    # A module of its own: the caller's (kept for a retry, or a later specialization) stays
    # unmarked, so its kernels still match a tuning database's by structure.
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
    for gv, func in list(mod.functions_items()):
        flags = constant.get(gv.name_hint)
        if not isinstance(func, tirx.PrimFunc) or not flags or not any(flags):
            continue
        free = [i for i, c in enumerate(flags) if c]
        mod[gv] = func.with_attr("layout_free_buffers", free)
    return mod


def split_repacking() -> Any:
    """TVM's ``SplitLayoutRewritePreproc`` on the kernels whose schedule repacked a weight:
    each repacking block becomes a kernel of its own, called on the weight before the
    kernel (``FoldConstant`` then runs it at build time).

    The other kernels are kept out of TVM's pass, which fails on a kernel without blocks
    (``scatter_elements``: "There should be a compute block if there is only one subtree
    under the root"), and lose their ``layout_free_buffers`` mark.
    """
    import tvm
    from tvm import relax, tirx

    from enginekit.backends.tvm.packing import PREPACK

    @tvm.transform.module_pass(opt_level=0, name="EnginekitSplitRepacking")
    def split(mod: Any, _ctx: Any) -> Any:
        packed, others = tvm.IRModule(attrs=mod.attrs), {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) or (
                isinstance(func, tirx.PrimFunc) and _repacks(func, PREPACK)
            ):
                packed[gv] = func
            elif isinstance(func, tirx.PrimFunc) and func.attrs is not None:
                others[gv] = func.without_attr("layout_free_buffers")
            else:
                others[gv] = func
        if not any(isinstance(f, tirx.PrimFunc) for f in packed.functions.values()):
            return mod
        out = relax.transform.SplitLayoutRewritePreproc()(packed)
        for gv, func in others.items():
            out[gv] = func
        return out

    return split


def fold_repacking(mod: Any) -> Any:
    """Compute each weight repacking that :func:`split_repacking` left as a call on a constant
    (``<kernel>_weight_prepack``) with numpy: ``[..., N]`` -> ``[N / t, ..., t]``, ``t`` the
    packed tile's last dim. ``FoldConstant`` would compile each repacking kernel with LLVM
    first (ResNet-50: ~50 of them, tens of seconds of build). A call whose shapes are not
    that layout is left to ``FoldConstant``."""
    import numpy as np
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class Fold(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            if not (
                call.op.same_as(call_tir)
                and call.args[0].name_hint.endswith("_weight_prepack")
                and isinstance(call.args[1], relax.Tuple)
                and len(call.args[1].fields) == 1
                and isinstance(call.args[1].fields[0], tvm.ir.GenericConst)
            ):
                return call
            weight = call.args[1].fields[0].value.numpy()
            shape = tuple(int(d) for d in call.ty.shape)
            tile = shape[-1]
            if weight.ndim < 2 or weight.shape[-1] % tile:
                return call
            tiles = weight.reshape(*weight.shape[:-1], weight.shape[-1] // tile, tile)
            packed = np.ascontiguousarray(np.moveaxis(tiles, -2, 0))
            if packed.shape != shape:
                return call
            return relax.const(packed, str(weight.dtype))

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = Fold().visit_expr(func)
    return mod


def _repacks(func: Any, key: str) -> bool:
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        stack = [sch.get_sblock("root")]
    except Exception:  # no root block (hand-written TIR): nothing was repacked
        return False
    while stack:
        for child in sch.get_child_blocks(stack.pop()):
            if key in sch.get(child).annotations:
                return True
            stack.append(child)
    return False


def apply_schedules(
    mod: Any,
    target: Any,
    schedule: str,
    database: Any = None,
    choices: bool = True,
    knobs: Mapping[str, Any] | None = None,
) -> tuple[Any, list[str]]:
    """Step 4: tuned kernels from ``database``, default schedules for the rest (with
    ``knobs``, a tuner's choices by kernel key, :mod:`.knobs`).

    Returns:
        the scheduled module and the names of the kernels the database supplied.
    """
    import tvm
    from tvm import relax
    from tvm.s_tir import dlight

    from enginekit.backends.tvm.placement import streamed_weights
    from enginekit.backends.tvm.schedule import cpu_rules, gpu_rules
    from enginekit.target import cache_bytes

    tuned: list[str] = []
    with target:
        if database is not None:
            with database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
            tuned = [k["name"] for k in kernel_summary(mod, blocks=False) if k["scheduled"]]
        if target.kind.name == "cuda":
            mod = dlight.ApplyDefaultSchedule(*gpu_rules())(mod)
        elif schedule == "enginekit":
            # Kernel parameters bound to constants are marked layout-free: the rule may repack
            # those weights, in a block of its own that is split out and folded at build time.
            mod = mark_layout_free(mod)
            with streamed_weights(constant_bytes(mod), cache_bytes()):
                mod = dlight.ApplyDefaultSchedule(*cpu_rules(target, choices, knobs))(mod)
            mod = tvm.transform.Sequential(
                [
                    split_repacking(),
                    tvm.transform.module_pass(
                        lambda m, _ctx: fold_repacking(m), opt_level=0, name="FoldRepacking"
                    ),
                    relax.transform.FoldConstant(),
                    relax.transform.DeadCodeElimination(),
                ]
            )(mod)
        elif schedule == "dlight":
            mod = dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())(mod)
    return mod, tuned


def schedule_and_compile(
    mod: Any,
    target: Any,
    schedule: str,
    database: Any = None,
    knobs: Mapping[str, Any] | None = None,
) -> tuple[Any, Any, list[str]]:
    """Steps 4-5: (the executable, the scheduled module, the kernels the database supplied).

    enginekit's CPU rule may give a kernel two schedules chosen at run time (padded matmul
    rows, serial small kernels); TVM 0.27's lowering fails on some of those ("Find divide by
    zero" on torchvision's ViT and Swin, timm's MobileViT), so a failed compile is retried
    once with one schedule per kernel.
    """
    # The passes may rewrite a module held once in place: the retry starts from a clone taken
    # first (the first attempt compiles ``mod`` itself: a build from a clone is not
    # byte-identical from one build to the next).
    backup = mod.clone()
    scheduled, tuned = apply_schedules(mod, target, schedule, database, knobs=knobs)
    try:
        return compile_module(scheduled, target), scheduled, tuned
    except BuildError as exc:
        if schedule != "enginekit" or target.kind.name == "cuda":
            raise
        log.info("tvm: %s; compiling again without run-time schedule choices", exc)
    scheduled, tuned = apply_schedules(backup, target, schedule, database, False, knobs)
    return compile_module(scheduled, target), scheduled, tuned


def compile_module(mod: Any, target: Any) -> Any:
    """Step 5: a Relax VM executable (``export_library`` writes it as a shared library)."""
    import tvm

    from enginekit.backends.tvm.stack import pipeline

    # On CPU, register tiles stay stack arrays, their epilogue reads and marked weight
    # streams are prefetched (:mod:`.stack`, :mod:`.prefetch`); elsewhere TVM's own pipeline.
    tir = pipeline() if target.kind.name == "llvm" else "default"
    try:
        return tvm.compile(mod, target=target, tir_pipeline=tir)
    except Exception as exc:
        raise BuildError(
            f"TVM failed to compile the program for {target.kind.name}: "
            f"{type(exc).__name__}: {error_line(exc)}"
        ) from None


# -- what the program became ---------------------------------------------------------------------


def _calls(func: Any) -> list[Any]:
    from tvm import relax

    calls: list[Any] = []
    relax.analysis.post_order_visit(
        func.body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None
    )
    return calls


def graph_summary(graph: Any) -> dict[str, Any]:
    """Layout facts of the optimized Relax graph (before lowering to kernels)."""
    from tvm import relax

    ops: Counter[str] = Counter()
    conv_layouts: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for _gv, func in graph.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for call in _calls(func):
            name = getattr(call.op, "name", None)
            if not isinstance(name, str):
                continue
            ops[name] += 1
            if name.startswith("relax.nn.conv"):
                conv_layouts[f"{call.attrs.data_layout}/{call.attrs.kernel_layout}"] += 1
                if name != "relax.nn.conv2d" and not call.attrs.data_layout.endswith("C"):
                    others[name.removeprefix("relax.nn.")] += 1
    notes = [
        f"{n} {op} kept in {('NCW' if op.endswith('1d') else 'NCDHW')}: TVM's ConvertLayout "
        "converts conv2d only"
        for op, n in sorted(others.items())
    ]
    return {
        "transposes": ops["relax.permute_dims"] + ops["relax.layout_transform"],
        "conv_layouts": dict(conv_layouts),
        "layout_notes": notes,
        "ops": dict(ops.most_common()),
    }


def _block_names(func: Any) -> list[str]:
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    names: list[str] = []

    def walk(block: Any) -> None:
        for child in sch.get_child_blocks(block):
            names.append(str(sch.get(child).name_hint))
            walk(child)

    walk(sch.get_sblock("root"))
    return names


def kernel_summary(mod: Any, blocks: bool = True) -> list[dict[str, Any]]:
    """Every TIR kernel of the lowered program: its name, the compute blocks fused into it
    (e.g. ``pad_temp, conv2d_nhwc, T_add, compute``) and whether a schedule was applied."""
    from tvm import tirx

    kernels = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        entry: dict[str, Any] = {
            # A kernel whose weights the schedule repacked is renamed ``<name>_prepacked``.
            "name": gv.name_hint.removesuffix("_prepacked"),
            "scheduled": bool(func.attrs and func.attrs.get("tirx.is_scheduled", False)),
        }
        if blocks:
            try:
                entry["blocks"] = _block_names(func)
            except Exception:  # a kernel without a root block (hand-written TIR)
                entry["blocks"] = []
        kernels.append(entry)
    return sorted(kernels, key=lambda k: k["name"])
