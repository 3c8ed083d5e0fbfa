"""ONNX Runtime's transformer fusions (``onnxruntime.transformers.optimizer``) at build time.

Its optimizer rewrites encoder/decoder subgraphs into ONNX Runtime's fused contrib ops
(``Attention``, ``SkipLayerNormalization``, ``BiasGelu``, ``FastGelu``, ...). A session's own
graph optimizer (level ``extended`` and above) already makes several of these itself
(``SkipLayerNormalization``, ``BiasGelu``, ``FastGelu``, ``LayerNormalization``): when every op
the optimizer fused is one the session makes on the unfused graph too, the fused graph is not
kept and nothing is timed (a timing of two equal graphs only picks noise). Otherwise the fused
graph is kept only where it measures faster than the unfused one at the build's opt shapes
(both with the session's optimizations on top). The build records what was fused, what the
session fuses itself, the two times and the choice as a pass in ``manifest["passes"]``. The
engine is verified against the user's model like every build.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import onnx

from enginekit.errors import BuildError
from enginekit.passes import PassRecord

log = logging.getLogger(__name__)

#: ``transformer_fusions`` option values: auto finds the model type, the others force it.
MODES = ("auto", "bert", "gpt2", "off")
#: Op types whose presence marks a transformer block (attention's softmax, a normalization).
_ATTENTION = {"Softmax"}
_NORMS = {"LayerNormalization", "SimplifiedLayerNormalization", "ReduceMean"}
#: Keep the fused graph only when it is at least this much faster (measurement noise).
MIN_GAIN = 1.03


def looks_like_transformer(proto: onnx.ModelProto) -> bool:
    """A MatMul graph with a Softmax and a normalization: an encoder or decoder block."""
    ops = {n.op_type for n in proto.graph.node}
    return "MatMul" in ops and bool(_ATTENTION & ops) and bool(_NORMS & ops)


def model_type(proto: onnx.ModelProto, mode: str) -> str | None:
    """The optimizer's model type for ``mode`` (None: leave the graph alone)."""
    if mode == "off":
        return None
    if mode != "auto":
        return mode
    if not looks_like_transformer(proto):
        return None
    # A causal mask (Trilu, or a Where on a triangular constant) marks a decoder.
    ops = {n.op_type for n in proto.graph.node}
    return "gpt2" if "Trilu" in ops else "bert"


def fuse(proto: onnx.ModelProto, kind: str) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The graph with ONNX Runtime's transformer fusions applied, and the count of each fused op."""
    from onnxruntime.transformers.optimizer import optimize_model

    # The optimizer logs every pattern it tries at INFO on the root logger's handlers.
    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        optimized = optimize_model(
            proto, model_type=kind, num_heads=0, hidden_size=0, opt_level=0, use_gpu=False
        )
    except Exception as exc:
        raise BuildError(f"ONNX Runtime's transformer optimizer failed ({kind}): {exc}") from None
    finally:
        quiet.setLevel(level)
    stats = {k: int(v) for k, v in optimized.get_fused_operator_statistics().items() if v}
    return optimized.model, stats


def _median_ms(run: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def choose(
    proto: onnx.ModelProto,
    mode: str,
    make_session: Callable[[bytes], Any],
    feeds: dict[str, Any] | None,
    rounds: int = 5,
    session_ops: Callable[[bytes], Counter[str]] | None = None,
) -> tuple[bytes, PassRecord | None]:
    """The model bytes to build (fused where measured faster) and the pass record.

    Args:
        proto: the model as the build would use it.
        mode: the ``transformer_fusions`` option (see :data:`MODES`).
        make_session: builds an ONNX Runtime session from model bytes (the build's options).
        feeds: inputs at the build's opt shapes to time both graphs on (None: no shapes known,
            the fused graph is kept untimed only when the mode forces a model type).
        session_ops: the op types, counted, of the graph a session makes of model bytes with
            the build's optimizations (None: not checked; every fusion is timed).
    """
    original = proto.SerializeToString()
    kind = model_type(proto, mode)
    if kind is None:
        return original, None
    start = time.perf_counter()
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)  # the optimizer rewrites the proto it is given in place
    fused, stats = fuse(copy, kind)
    seconds = time.perf_counter() - start
    before, after = len(proto.graph.node), len(fused.graph.node)
    detail: dict[str, Any] = {"model_type": kind, "fused": stats}
    if not stats:
        detail["kept"] = False
        detail["why"] = "no pattern matched"
        return original, PassRecord("transformer_fusions", before, before, seconds, detail)
    if mode == "auto" and session_ops is not None:
        own = session_ops(original)
        detail["session_fuses"] = {op: own.get(op, 0) for op in stats}
        if all(own.get(op, 0) >= n for op, n in stats.items()):
            detail["kept"] = False
            detail["why"] = "the session's own optimizer makes these fused ops itself"
            return original, PassRecord("transformer_fusions", before, before, seconds, detail)
    fused_bytes = fused.SerializeToString()
    if feeds is None:
        keep = mode != "auto"
        detail["why"] = "forced by the option, untimed" if keep else "no opt shapes to time on"
    else:
        plain_s, fused_s = make_session(original), make_session(fused_bytes)
        for s in (plain_s, fused_s):
            s.run(None, feeds)
        # Interleaved rounds, so that load on the machine hits both alike.
        plain_times, fused_times = [], []
        for _ in range(rounds):
            plain_times.append(_median_ms(lambda: plain_s.run(None, feeds), 1))
            fused_times.append(_median_ms(lambda: fused_s.run(None, feeds), 1))
        plain_ms, fused_ms = statistics.median(plain_times), statistics.median(fused_times)
        keep = plain_ms >= fused_ms * MIN_GAIN or mode != "auto"
        detail.update(unfused_ms=round(plain_ms, 3), fused_ms=round(fused_ms, 3))
        detail["why"] = (
            "forced by the option" if mode != "auto"
            else f"measured {'faster' if keep else 'not faster'} at the opt shapes"
        )  # fmt: skip
    detail["kept"] = keep
    log.info("transformer fusions (%s): %s, kept=%s", kind, stats, keep)
    if not keep:
        return original, PassRecord("transformer_fusions", before, before, seconds, detail)
    return fused_bytes, PassRecord("transformer_fusions", before, after, seconds, detail)
