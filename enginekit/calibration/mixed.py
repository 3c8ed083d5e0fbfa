"""The bf16 float part of an accuracy-aware int8 build, and the layers in it that stay f32.

Where the layers an int8 plan keeps out of int8 compute in bf16 (``fallback`` bf16:
:func:`enginekit.calibration.search.fallback_precision`), bf16 costs agreement unevenly: on
MobileNetV2 and EfficientNet-Lite0 the whole model in bf16 agrees with fp32 on 93.5-94.5% of
photo crops, and most of that loss sits in the first one or two layers (docs/calibration.md).
So before the int8 search, :func:`choose_f32_layers` picks which layers of the float part stay
f32, with the machinery the int8 search ranks its layers with:

1. the float model whole in bf16 is scored on the held-out rows; if it meets the target, no
   layer stays f32;
2. sensitivity: each weighted layer (Conv, ConvTranspose, MatMul, Gemm) *alone* in bf16, every
   other one f32, its output NMSE measured on the calibration (fitting) rows;
3. the ``k`` most bf16-sensitive layers kept f32, ``k`` = 1, 2, 4, ... until the float part
   alone (the float model, no int8) meets the target on the held-out rows, then bisected down
   to the smallest passing ``k``: fewest f32 layers first, since each costs bf16's speed.

The int8 search then runs on top, every plan measured with those layers f32 (layers a plan
quantizes stay int8). The build's backend gets them as its option (``F32_OPTIONS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import onnx

from enginekit.calibration.accuracy import ort_runner
from enginekit.calibration.scoring import measure
from enginekit.calibration.search import rank_alone

if TYPE_CHECKING:
    from enginekit.calibration.search import AccuracyTarget, Feeds, Runner

#: The layers whose precision a backend's f32 marks control (what bf16 rounds the inputs and
#: weights of); other ops follow them or stay in the hint's precision.
WEIGHTED = ("Conv", "ConvTranspose", "MatMul", "Gemm")
#: Backends that keep named layers f32 inside a bf16 float part, and the option that names them.
F32_OPTIONS = {"openvino": "f32_layers"}

#: f32 layers -> a runner of models with those layers f32 and the rest of the float part bf16.
RunnerFor = Callable[[Sequence[str]], "Runner"]


@dataclasses.dataclass(frozen=True)
class FloatPart:
    """What the float part of the chosen int8 plan computes in, and why (for the manifest).

    Attributes:
        precision: ``bf16`` or ``float`` (float32).
        reason: why that precision (the host, the backend, its options).
        f32_layers: layers kept f32 inside a bf16 float part.
        how: how ``f32_layers`` were chosen: ``searched``, ``given`` (the backend option),
            or why no search ran.
        sensitivity: each weighted layer's output NMSE alone in bf16, most sensitive first.
        plans: each float-part plan scored: f32 layers, agreement, NMSE, met.
        rows: held-out rows the float-part plans were scored on.
        fit_rows: rows the sensitivity was measured on.
    """

    precision: str
    reason: str
    f32_layers: tuple[str, ...] = ()
    how: str = ""
    sensitivity: tuple[tuple[str, float], ...] = ()
    plans: tuple[Mapping[str, Any], ...] = ()
    rows: int = 0
    fit_rows: int = 0

    def manifest_entry(self) -> dict[str, Any]:
        rank = {name: i for i, (name, _) in enumerate(self.sensitivity)}
        error = dict(self.sensitivity)

        def why(name: str) -> str:
            if name not in rank:
                return "given by the backend option"
            return (
                f"bf16 sensitivity rank {rank[name] + 1} of {len(rank)}: alone in bf16 (every "
                f"other weighted layer f32) it gives an output NMSE of {error[name]:.3g}"
            )

        return {
            "precision": self.precision,
            "reason": self.reason,
            "f32_layers_chosen": self.how,
            "f32_layers": [{"layer": n, "why": why(n)} for n in self.f32_layers],
            "sensitivity_rows": self.fit_rows,
            "rows": self.rows,
            "plans": [dict(p) for p in self.plans],
        }


def weighted_layers(model: onnx.ModelProto) -> list[str]:
    """Names of the model's weighted layers, in graph order."""
    return [n.name for n in model.graph.node if n.op_type in WEIGHTED and n.name]


def choose_f32_layers(
    source: onnx.ModelProto,
    rows: Sequence[Feeds],
    fit_rows: Sequence[Feeds],
    target: AccuracyTarget,
    runner_for: RunnerFor,
    reason: str,
) -> FloatPart:
    """The fewest layers of ``source`` to keep f32 for its bf16 float part alone to meet
    ``target`` on ``rows`` (module doc). Every weighted layer f32 when nothing less does.

    Args:
        rows: held-out batches the float-part plans are scored on.
        fit_rows: calibration batches the sensitivity is measured on (``rows`` without them).
        runner_for: f32 layers -> runner (the backend's plan runner with its f32 option).
        reason: why the float part is bf16 (for the manifest).
    """
    reference = _run(ort_runner(source), rows)
    count = sum(_rows(f) for f in rows)
    plans: list[dict[str, Any]] = []

    def score(kept: Sequence[str]) -> bool:
        metrics = measure(_run(runner_for(kept)(source), rows), reference)
        met = target.met(metrics)
        plans.append(
            {
                "f32_layers": len(kept),
                "layers": list(kept),
                "top1_agreement": metrics["top1_agreement"],
                "top1_interval": metrics.get("top1_interval"),
                "top1_lower_bound": target.lower(metrics),
                "rows": metrics.get("rows"),
                "max_abs": metrics["max_abs"],
                "nmse": metrics["nmse"],
                "met": met,
            }
        )
        return met

    def part(
        kept: Sequence[str], how: str, sensitivity: Sequence[tuple[str, float]] = ()
    ) -> FloatPart:
        return FloatPart(
            "bf16", reason, tuple(kept), how, tuple(sensitivity), tuple(plans), count, sample
        )

    layers = weighted_layers(source)
    sample = 0
    if score(()) or not layers:
        return part((), "searched: the whole float part in bf16 meets the target")
    fitted = list(fit_rows or rows)
    sensitivity, sample = _sensitivity(source, layers, fitted, runner_for)
    order = [n for n, _ in sensitivity]
    budget, fail, hi = target.max_plans, 0, len(order)
    k = 1
    while budget and k < len(order):  # doubling: 1, 2, 4, ... f32 layers
        budget -= 1
        if score(order[:k]):
            hi = k
            break
        fail, k = k, min(2 * k, len(order))
    while budget and hi - fail > 1:  # bisect down to the fewest that pass
        mid = (fail + hi) // 2
        budget -= 1
        if score(order[:mid]):
            hi = mid
        else:
            fail = mid
    if hi == len(order) and not any(p["met"] for p in plans):
        met = score(order)  # reported: what the float part reads with every layer f32
        return part(
            order,
            "searched: no smaller set met the target in bf16, so every weighted layer is f32"
            + ("" if met else " (and even that misses it: other ops still compute in bf16)"),
            sensitivity,
        )
    return part(
        order[:hi], "searched: the fewest most bf16-sensitive layers f32 that meet it", sensitivity
    )


def _sensitivity(
    source: onnx.ModelProto, layers: Sequence[str], rows: Sequence[Feeds], runner_for: RunnerFor
) -> tuple[list[tuple[str, float]], int]:
    """Each layer's output NMSE alone in bf16 (the others f32), most sensitive first, and the
    rows it was measured on."""
    return rank_alone(
        source, layers, rows, lambda name: runner_for([n for n in layers if n != name])(source)
    )


def _run(run: Callable[[Feeds], Sequence[Any]], rows: Sequence[Feeds]) -> list[Any]:
    return [list(run(feeds)) for feeds in rows]


def _rows(feeds: Feeds) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1
