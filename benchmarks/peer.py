"""enginekit against its peers on real architectures, side by side in one run.

ResNet-50 (torchvision, random weights) at batch 1 and 16, and a BERT-base-shaped encoder
(transformers' BertConfig defaults, random weights) at batch 8 x sequence 128. Engines, timed
interleaved (one call each per round, rounds repeated) so that load on the machine hits them
all alike:

- a plain ONNX Runtime session on the exported model (the baseline, ratio 1.00);
- OpenVINO's default (``ov.Core().compile_model(model, "CPU")``: bf16 on CPUs that have it) and
  OpenVINO at f32 (``INFERENCE_PRECISION_HINT=f32``);
- every enginekit backend x precision this host can build (``--backends``): fp32, int8
  (calibrated on random inputs of the model's kind), bf16/fp16 where offered and the ISA has it;
  at batch 1 also enginekit's OpenVINO fp32 built for a fixed batch-1 profile;
- the engine ``--backend auto`` picks (``--auto-backends``; with the calibration data, so int8
  candidates too), gated on top-1 agreement >= 0.99 with fp32 on held-out verification rows.

Prints, per model and batch: median latency, speed relative to the plain ORT session (and the
lowest and highest of the per-round ratios: one round pairs each engine's call with the plain
session's) and to OpenVINO's default, the load average over the timing, and each engine's
accuracy against the float32 model (cosine similarity of the outputs, top-1 agreement of the
last axis: classes for ResNet, the hidden unit per token for the encoder). Also the host's CPU and ISA flags: ratios differ a lot between CPUs. Ends with
the goals of issue 16, each met or not met.

    python benchmarks/peer.py [--rounds 5] [--size 224] [--backends onnxruntime,openvino,xla]
                              [--auto-backends onnxruntime,openvino] [--models resnet50,bert]
                              [--precisions fp32,int8] [--gap 0.2] [--cache DIR]
                              [--json out.json]
    python benchmarks/peer.py --quick      # a smoke test that the suite runs: tiny shapes

TVM is opt-in (``--backends ...,tvm``): untuned it is 50-150x slower than ONNX Runtime and
tuning takes hours (docs/backends/tvm.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import enginekit as ek
from enginekit import target

Feeds = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model exported once, and the batches it is timed at."""

    name: str
    path: Path
    batches: tuple[Feeds, ...]
    shapes: dict[str, Any]
    calib: Feeds
    verify: Feeds | None = None  # rows auto's accuracy gate runs on (never calibrated on)


# -- models --------------------------------------------------------------------------------------


def _torchvision() -> Any:
    import torch

    # PyPI's torchvision wheel registers its C++ ops for a CUDA torch; with the CPU torch,
    # importing it fails unless these two schemas exist (no NMS is used here).
    global _TV_LIB
    if "_TV_LIB" not in globals():
        _TV_LIB = torch.library.Library("torchvision", "DEF")
        _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


def resnet50(cache: Path, size: int, batches: tuple[int, ...], quick: bool) -> Workload:
    import torch

    path = cache / f"resnet50-{size}.onnx"
    if not path.exists():
        torch.manual_seed(0)
        tv = _torchvision()
        model = (tv.models.resnet18 if quick else tv.models.resnet50)(weights=None).eval()
        ek.export(model, (torch.randn(2, 3, size, size),), path, dynamic_batch=True)
    rng = np.random.default_rng(0)
    top = max(batches)
    return Workload(
        f"{'resnet18' if quick else 'resnet50'} {size}x{size}",
        path,
        tuple({"x": rng.standard_normal((b, 3, size, size)).astype(np.float32)} for b in batches),
        # opt at batch 1: auto ranks its candidates at the opt shape, and batch 1 is the goal
        {"x": [(1, 3, size, size), (1, 3, size, size), (top, 3, size, size)]},
        {"x": rng.standard_normal((20, 3, size, size)).astype(np.float32)},
        {"x": rng.standard_normal((32, 3, size, size)).astype(np.float32)},
    )


def bert(cache: Path, batch: int, seq: int, quick: bool) -> Workload:
    import torch

    _torchvision()  # transformers imports torchvision when it is installed: the schemas first
    from transformers import BertConfig, BertModel

    config = BertConfig(attn_implementation="eager")
    if quick:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, attn_implementation="eager")  # fmt: skip
    path = cache / f"bert-{'tiny' if quick else 'base'}.onnx"
    if not path.exists():
        torch.manual_seed(0)

        class Encoder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = BertModel(config).eval()

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
                return self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]

        ids = torch.randint(0, config.vocab_size, (2, 16))
        ek.export(Encoder().eval(), (ids, torch.ones_like(ids)), path, dynamic_batch=True,
                  dynamic_dims={"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}},
                  output_names=["hidden"])  # fmt: skip
    rng = np.random.default_rng(0)

    def feeds(b: int) -> Feeds:
        mask = np.ones((b, seq), np.int64)
        mask[:, seq - seq // 4 :] = 0  # padding at the end, as real batches have
        return {"input_ids": rng.integers(0, config.vocab_size, (b, seq)), "attention_mask": mask}

    shape = [(1, seq), (batch, seq), (batch, seq)]
    return Workload(
        f"bert-{'tiny' if quick else 'base'} seq {seq}",
        path,
        (feeds(batch),),
        {"input_ids": shape, "attention_mask": shape},
        feeds(20),
        feeds(8),
    )


# -- engines -------------------------------------------------------------------------------------


def plain_ort(path: Path) -> Callable[[Feeds], np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)[0]


def openvino(path: Path, f32: bool) -> Callable[[Feeds], np.ndarray]:
    import openvino as ov

    config = {"INFERENCE_PRECISION_HINT": "f32"} if f32 else {}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request = compiled.create_infer_request()

    def run(feeds: Feeds) -> np.ndarray:
        request.infer(feeds)
        return np.array(request.get_output_tensor(0).data)

    return run


def enginekit_engines(
    w: Workload, backends: list[str], precisions: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Every backend x precision this host can build (only ``precisions`` when given); a failed
    build is reported, not fatal."""
    out: dict[str, Any] = {}
    for name in backends:
        try:
            avail = ek.backends.availability(name)
        except ek.BackendUnavailable as exc:  # not registered at all
            out[f"enginekit {name}"] = f"unavailable: {exc}"
            continue
        if not avail.available:
            out[f"enginekit {name}"] = f"unavailable: {avail.reason}"
            continue
        offered = getattr(ek.backends.get(name), "PRECISIONS", ("fp32",))
        for precision in offered:
            if precisions is not None and precision not in precisions:
                continue
            if precision in ("fp16", "bf16") and not _native(precision):
                continue
            if name == "onnxruntime" and precision in ("fp16", "bf16"):
                continue  # CUDA only (its CPU provider has no bf16/fp16 kernels)
            label = f"enginekit {name} {precision}"
            args: dict[str, Any] = {}
            if precision == "int8":
                args = {
                    "calib_data": w.calib,
                    "calib_method": "percentile",
                    "verify_data": w.verify,
                }
            start = time.perf_counter()
            try:
                engine = ek.build(w.path, backend=name, shapes=w.shapes, precision=precision,
                                  **args)  # fmt: skip
            except ek.EnginekitError as exc:
                out[label] = f"does not build: {type(exc).__name__}: {str(exc)[:160]}"
                continue
            print(f"  built {label} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            out[label] = engine
    return out


def fixed_batch_openvino(w: Workload) -> Any:
    """enginekit's OpenVINO fp32 built for a fixed batch-1 profile (static shapes), or why not."""
    spec = {name: dims[0] for name, dims in w.shapes.items()}  # the min shape: batch 1
    try:
        return ek.build(w.path, backend="openvino", shapes=spec)
    except ek.EnginekitError as exc:
        return f"does not build: {type(exc).__name__}: {str(exc)[:160]}"


def auto_engine(w: Workload, backends: list[str], duration: float) -> Any:
    """The engine ``--backend auto`` picks among ``backends`` x host precisions (int8 with the
    calibration data), gated on ``w.verify``; or why none."""
    start = time.perf_counter()
    try:
        engine = ek.build(
            w.path, backend="auto", shapes=w.shapes, backends=backends, calib_data=w.calib,
            calib_method="percentile", verify_data=w.verify, bench_duration=duration,
        )  # fmt: skip
    except ek.EnginekitError as exc:
        return f"auto failed: {type(exc).__name__}: {str(exc)[:300]}"
    auto = engine.manifest["auto"]
    print(f"  auto built {len(auto['candidates'])} candidates in "
          f"{time.perf_counter() - start:.0f} s:", file=sys.stderr)  # fmt: skip
    for c in auto["candidates"]:
        top1 = (c.get("agreement") or {}).get("top1")
        print(f"    {c['label']:<24} top-1 {'-' if top1 is None else f'{top1:.1%}'}  "
              f"{c.get('verdict', c['status'])[:150]}", file=sys.stderr)  # fmt: skip
    return engine


def _first_output(engine: Any) -> Callable[[Feeds], np.ndarray]:
    name = engine.outputs[0].name
    return lambda feeds: engine.infer(feeds)[name]


def _native(precision: str) -> bool:
    flags = target.cpu_flags()
    want = {"bf16": {"avx512_bf16", "amx_bf16", "bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}
    return bool(want[precision] & flags)


# -- measuring -----------------------------------------------------------------------------------


def loadavg() -> float | None:
    """The 1-minute load average (None where /proc/loadavg does not exist)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def paired(base: list[float], times: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of the per-round ratios ``base[i] / times[i]``: how far one
    round's pair can sit from the median on a loaded machine (equal lengths required)."""
    if len(base) != len(times) or not base:
        raise ValueError(f"paired ratios need equal, non-empty rounds: {len(base)} vs {len(times)}")
    ratios = [b / t for b, t in zip(base, times)]
    return statistics.median(ratios), min(ratios), max(ratios)


def accuracy(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(mean cosine similarity per sample, top-1 agreement along the last axis)."""
    g = got.reshape(got.shape[0], -1).astype(np.float64)
    r = ref.reshape(ref.shape[0], -1).astype(np.float64)
    cos = (g * r).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1) + 1e-30)
    top1 = (got.argmax(-1) == ref.argmax(-1)).mean()
    return float(cos.mean()), float(top1)


PLAIN = "onnxruntime session (plain)"
FIXED = "enginekit openvino fp32 [b1 profile]"


def measure(
    w: Workload,
    backends: list[str],
    rounds: int,
    auto_backends: list[str] | None = None,
    auto_duration: float = 0.5,
    gap: float = 0.2,
    precisions: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Every engine on every batch of ``w``, timed interleaved; one row per engine and batch.

    Each round calls every engine once, in an order rotated by one every round, each call after
    ``gap`` idle seconds (the previous engine's threads stop spinning)."""
    runners: dict[str, Any] = {PLAIN: plain_ort(w.path)}
    for label, f32 in (("openvino default", False), ("openvino f32", True)):
        try:
            runners[label] = openvino(w.path, f32)
        except Exception as exc:  # not installed, or cannot read the model
            runners[label] = f"unavailable: {exc}"[:200]
    for label, engine in enginekit_engines(w, backends, precisions).items():
        runners[label] = engine if isinstance(engine, str) else _first_output(engine)
    only_b1: set[str] = set()
    if "openvino" in backends and any(b[next(iter(b))].shape[0] == 1 for b in w.batches):
        fixed = fixed_batch_openvino(w)
        runners[FIXED] = fixed if isinstance(fixed, str) else _first_output(fixed)
        only_b1.add(FIXED)
    auto: dict[str, Any] = {}
    if auto_backends:
        engine = auto_engine(w, auto_backends, auto_duration)
        if isinstance(engine, str):
            runners["enginekit auto"] = engine
        else:
            auto = engine.manifest["auto"]
            runners[f"enginekit auto -> {auto['winner']}"] = _first_output(engine)
    rows = []
    for feeds in w.batches:
        batch = next(iter(feeds.values())).shape[0]
        live = {
            k: v for k, v in runners.items() if callable(v) and (batch == 1 or k not in only_b1)
        }
        ref = live[PLAIN](feeds)
        outputs = {k: run(feeds) for k, run in live.items()}  # also the warm-up
        times: dict[str, list[float]] = {k: [] for k in live}
        order = list(live)
        loads = [loadavg()]
        for i in range(rounds):
            for k in order[i % len(order) :] + order[: i % len(order)]:
                time.sleep(gap)
                start = time.perf_counter()
                live[k](feeds)
                times[k].append(time.perf_counter() - start)
        loads.append(loadavg())
        base = statistics.median(times[PLAIN])
        ov_default = statistics.median(times.get("openvino default", [float("nan")]))
        for k, v in runners.items():
            if k in only_b1 and batch != 1:
                continue
            if not callable(v):
                rows.append({"model": w.name, "batch": batch, "engine": k, "note": v})
                continue
            ms = statistics.median(times[k])
            cos, top1 = accuracy(outputs[k], ref)
            _, lo, hi = paired(times[PLAIN], times[k])
            row = {
                "model": w.name, "batch": batch, "engine": k, "ms": ms * 1e3,
                "vs_ort": base / ms, "vs_ort_rounds": [lo, hi], "vs_ov_default": ov_default / ms,
                "cosine": cos, "top1": top1, "load": loads,
            }  # fmt: skip
            if k.startswith("enginekit auto"):
                winner = next(c for c in auto["candidates"] if c["label"] == auto["winner"])
                row.update(auto_winner=auto["winner"], auto_precision=winner["precision"],
                           gate_top1=(winner.get("agreement") or {}).get("top1"),
                           gate_data=auto.get("agreement_data"))  # fmt: skip
            rows.append(row)
    return rows


# -- goals ---------------------------------------------------------------------------------------


def _best(rows: list[dict[str, Any]], model: str, batch: int, kind: str) -> dict[str, Any] | None:
    """The fastest enginekit row of ``kind`` (``fp32``, ``int8``) for a model and batch."""
    found = [r for r in rows if r["model"].startswith(model) and r["batch"] == batch and "ms" in r
             and r["engine"].startswith("enginekit ") and not r["engine"].startswith("enginekit auto")
             and f" {kind}" in r["engine"]]  # fmt: skip
    return min(found, key=lambda r: r["ms"]) if found else None


def _ms(rows: list[dict[str, Any]], model: str, batch: int, engine: str) -> float | None:
    for r in rows:
        if r["model"].startswith(model) and r["batch"] == batch and r["engine"] == engine:
            return r.get("ms")
    return None


def goals(rows: list[dict[str, Any]], quick: bool = False) -> list[dict[str, Any]]:
    """Issue 16's goals from the rows: each with the measured value and met / not met (None:
    not measured in this run)."""
    r50, enc = ("resnet18" if quick else "resnet50"), "bert"
    out = []

    def add(goal: str, value: float | None, target: float, note: str = "") -> None:
        met = None if value is None else value >= target
        out.append({"goal": goal, "value": value, "target": target, "met": met, "note": note})

    # the encoder at the batch it ran at (8, or 2 with --quick)
    enc_batch = next((r["batch"] for r in rows if r["model"].startswith(enc)), 8)
    for model, batch, label in ((r50, 1, "ResNet-50 b1"), (enc, enc_batch, "encoder")):
        best = _best(rows, model, batch, "fp32")
        ov = _ms(rows, model, batch, "openvino f32")
        plain = _ms(rows, model, batch, PLAIN)
        name = best["engine"] if best else "none"
        add(f"{label}: best enginekit fp32 vs OpenVINO f32 >= 1.0x",
            ov / best["ms"] if best and ov else None, 1.0, name)  # fmt: skip
        spread = (f"{name}; rounds {_span(best.get('vs_ort_rounds'))}, load "
                  f"{_span(best.get('load'))}") if best else name  # fmt: skip
        add(f"{label}: best enginekit fp32 vs plain ORT >= 1.2x",
            plain / best["ms"] if best and plain else None, 1.2, spread)  # fmt: skip
    auto = next((r for r in rows if r["model"].startswith(r50) and r["batch"] == 1
                 and r["engine"].startswith("enginekit auto") and "ms" in r), None)  # fmt: skip
    add("ResNet-50 b1: auto (with calibration data) vs OpenVINO default >= 1.3x",
        auto["vs_ov_default"] if auto else None, 1.3,
        f"{auto['auto_winner']}" if auto else "")  # fmt: skip
    add("ResNet-50 b1: auto's top-1 agreement with fp32 >= 99% (verification rows)",
        auto.get("gate_top1") if auto else None, 0.99,
        f"on {auto.get('gate_data')}" if auto else "")  # fmt: skip
    int8 = _best(rows, r50, 16, "int8")
    vnni = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & target.cpu_flags())
    add("ResNet-50 b16: best int8 vs fp32 plain ORT >= 3x" + ("" if vnni else " (VNNI host)"),
        int8["vs_ort"] if int8 else None, 3.0,
        (int8["engine"] if int8 else "none") + ("" if vnni else "; this host has no VNNI: "
                                                "the goal is for VNNI hosts"))  # fmt: skip
    return out


def print_goals(found: list[dict[str, Any]]) -> None:
    print("goals (issue 16)")
    for g in found:
        state = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.2f}"
        print(f"  {state:<12} {value:>6} (target {g['target']:g})  {g['goal']}"
              + (f"  [{g['note']}]" if g["note"] else ""))  # fmt: skip


def _span(values: list[float | None] | None, fmt: str = ".2f") -> str:
    """``lo-hi`` of the known values, ``-`` where none are known."""
    known = [v for v in values or () if v is not None]
    return f"{min(known):{fmt}}-{max(known):{fmt}}" if known else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'model':<22} {'batch':>5} {'engine':<44} {'ms':>9} {'vs ORT':>7} {'rounds':>11} "
              f"{'vs OV def':>9} {'cosine':>8} {'top-1':>6} {'load':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        if "note" in r:
            print(f"{r['model']:<22} {r['batch']:>5} {r['engine']:<44} {r['note']}")
            continue
        print(
            f"{r['model']:<22} {r['batch']:>5} {r['engine']:<44} {r['ms']:9.2f} "
            f"{r['vs_ort']:6.2f}x {_span(r.get('vs_ort_rounds')):>11} {r['vs_ov_default']:8.2f}x "
            f"{r['cosine']:8.5f} {r['top1']:6.1%} {_span(r.get('load')):>11}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: ResNet-18 at 32x32 batch 1 "
                   "and 16, a 2-layer tiny BERT at batch 2 x 16, two rounds, onnxruntime + "
                   "openvino (minutes)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5, help="timed calls per engine (interleaved)")
    p.add_argument("--size", type=int, default=224, help="ResNet input size (default 224)")
    p.add_argument("--models", default="resnet50,bert")
    p.add_argument("--backends", default="onnxruntime,openvino,xla")
    p.add_argument("--auto-backends", default="onnxruntime,openvino",
                   help="backends --backend auto chooses among ('' for no auto row)")  # fmt: skip
    p.add_argument("--auto-duration", type=float, default=0.5,
                   help="auto's bench seconds per candidate (default 0.5)")  # fmt: skip
    p.add_argument("--precisions", help="enginekit precisions to build, e.g. fp32 (default: "
                   "every one the host can run)")  # fmt: skip
    p.add_argument("--gap", type=float, default=0.2,
                   help="idle seconds before each timed call: the previous engine's threads "
                   "stop spinning (default 0.2)")  # fmt: skip
    p.add_argument("--cache", help="keep exported models here (reused by the next run)")
    p.add_argument("--json", metavar="PATH", help="also write rows, goals and host to this file")
    args = p.parse_args(argv)
    quick = args.quick
    rounds = 2 if quick else args.rounds
    size = 32 if quick else args.size
    backends = ["onnxruntime", "openvino"] if quick else args.backends.split(",")
    auto_backends = [b for b in args.auto_backends.split(",") if b]
    cache = Path(args.cache or tempfile.mkdtemp(prefix="enginekit-peer-"))
    cache.mkdir(parents=True, exist_ok=True)
    print(
        f"host: {target.cpu_name()}, {os.cpu_count()} cores; ISA: {' '.join(sorted(target.cpu_flags()))}"
    )
    print(f"enginekit {ek.__version__}; {rounds} interleaved rounds per engine; a loaded machine "
          "shows in the absolute times, much less in the ratios\n")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        if model == "resnet50":
            w = resnet50(cache, size, (1, 16), quick)
        elif model == "bert":
            w = bert(cache, 2 if quick else 8, 16 if quick else 128, quick)
        else:
            p.error(f"unknown model {model!r}: resnet50 or bert")
        print(f"{w.name}: building and timing", file=sys.stderr)
        precisions = tuple(args.precisions.split(",")) if args.precisions else None
        done = measure(w, backends, rounds, auto_backends, args.auto_duration, args.gap, precisions)
        print_table(done)  # each model as it finishes: a long run shows results early
        print(flush=True)
        rows += done
    found = goals(rows, quick)
    print_goals(found)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"host": target.host(), "rows": rows, "goals": found}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
