"""TVM backend vs ONNX Runtime, measured side by side in one run, on a ResNet-style CNN and a
small BERT (transformers, random weights; skipped when transformers is not installed).

Rows: ONNX Runtime (default session), TVM with enginekit's default schedules (untuned; NHWC and
NCHW for the CNN), for BERT the same with ``specialize=False`` ("dynamic only": without the
static-shape modules for batch 1 and the opt batch that a model with a symbolic sequence gets
by default, so every call runs the symbolic module), optionally TVM tuned with a small
MetaSchedule budget. Columns: build
(compile) and tuning seconds, median latency per batch size, and the ratio to ONNX Runtime
(latency / ORT's: below 1 is faster than ORT). The host's CPU and ISA flags are printed: the
ratios differ between AVX-512 and AVX2-only hosts.

    python benchmarks/tvm_bench.py                      # CNN 64x64 + BERT seq 32, batches 1,16
    python benchmarks/tvm_bench.py --models cnn --size 112 --trials 64 --batches 1,8,32
    python benchmarks/tvm_bench.py --json               # the results and goals as JSON
    python benchmarks/tvm_bench.py --models corpus --corpus tv-mobilenet_v3_small,tv-resnet50
                                                        # corpus CNNs (64x64), batches 1,16
    python benchmarks/tvm_bench.py --models corpus --corpus tv-resnet50 --batches 1 \
        --trials 600 --tuning-db r50-db/   # MetaSchedule-tuned ResNet-50 at batch 1; rerun: no trials
    python benchmarks/tvm_bench.py --models corpus --corpus tv-resnet50 --roofline
                                        # + latency floors, the goal against them, TVM per kernel

On a host with AVX512-BF16 a ``tvm NHWC bf16`` row is added (precision bf16). The goals table
at the end says met / not met: untuned TVM NHWC at least as fast as ONNX Runtime on the CNN
(ratio <= 1.0) at every batch size, the transformer within 1.25x of ONNX Runtime and its
dynamic-only build at least 0.8x the speed of the build with static modules; with
--trials, a tuned corpus entry at least 1.3x ONNX Runtime's speed at batch 1 with at most 20
minutes of tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np


def resnet(channels: tuple[int, ...] = (32, 64, 128, 256)) -> object:
    """A small ResNet: stem, four residual stages (stride 2 after the first), head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + self.skip(x))

    layers = [
        nn.Conv2d(3, channels[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(channels[0]),
        nn.ReLU(),
    ]
    cin = channels[0]
    for i, cout in enumerate(channels):
        layers.append(Block(cin, cout, 1 if i == 0 else 2))
        cin = cout
    torch.manual_seed(0)
    body = nn.Sequential(*layers)
    head = nn.Linear(cin, 10)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = body, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x).mean((2, 3)))

    return Net().eval()


#: Seconds between one engine's block of calls and the next engine's (``--pause``). ONNX
#: Runtime's default session keeps its intra-op threads spinning after a call returns; timed
#: right after an ORT block, TVM's two-thread pool shared the 2-core host with them: the demo
#: CNN at batch 1 measured 26-28 ms per TVM call straight after ORT's block against 11-20 ms
#: alone in the same process, and 12-17 ms after ORT's block with ORT's spinning off (2 runs
#: each, loaded host). A pause lets the spinning end, so each engine is timed on its own.
PAUSE_S = 0.3


def latency_ms(engines: dict, feeds: dict, rounds: int, pause: float = PAUSE_S) -> dict[str, float]:
    """Median per-call latency of each engine, the engines interleaved round by round; each
    round times enough calls of an engine to last ~0.1 s, ``pause`` seconds after the
    previous engine's block (see :data:`PAUSE_S`)."""
    calls = {}
    for name, engine in engines.items():
        engine.infer(feeds)  # warm up
        start = time.perf_counter()
        engine.infer(feeds)
        calls[name] = max(1, min(50, int(0.1 / (time.perf_counter() - start))))
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            if pause:
                time.sleep(pause)
            engine.infer(feeds)  # its own threads awake again
            start = time.perf_counter()
            for _ in range(calls[name]):
                engine.infer(feeds)
            samples[name].append((time.perf_counter() - start) / calls[name] * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


_TORCHVISION_SCHEMAS = None


def bert(hidden: int = 128, layers: int = 2, heads: int = 4) -> object | None:
    """A small BERT encoder (transformers' own module code, random weights), or None."""
    import torch

    # transformers imports torchvision; PyPI's torchvision wheel registers kernels for two ops
    # its C++ library (built for a CUDA torch) does not define on this CPU torch.
    global _TORCHVISION_SCHEMAS
    try:
        _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")
        _TORCHVISION_SCHEMAS.define(
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
        _TORCHVISION_SCHEMAS.define(
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
    except RuntimeError:  # already defined (a working torchvision, or a second call)
        pass
    try:
        import transformers
    except ImportError:
        return None

    config = transformers.BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, vocab_size=1000, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids).last_hidden_state

    return Encoder().eval()


def _run(
    title: str,
    path: Path,
    shapes: dict,
    configs: dict,
    feeds_of,
    batches,
    rounds,
    quiet=False,
    pause: float = PAUSE_S,
    inspect=None,
) -> dict:
    """Build every config, time them interleaved; print the table (unless ``quiet``) and
    return ``{engine: {"build_s", "tune_s", "ms": {batch: ms}, "ratio": {batch: ratio}}}``;
    ``inspect(engines)`` is called before the engines close (the per-kernel roofline check)."""
    import enginekit as ek

    say = (lambda *a, **k: None) if quiet else print

    engines, build_s, tune_s = {}, {}, {}
    for name, options in configs.items():
        start = time.perf_counter()
        engines[name] = ek.build(path, shapes=shapes, **options)
        build_s[name] = time.perf_counter() - start
        tuning = engines[name].manifest["backend"].get("metadata", {}).get("tuning")
        tune_s[name] = tuning["seconds"] if tuning else 0.0
        say(f"built {title} {name}: {build_s[name]:.1f} s", flush=True)
        for b, d in ((tuning or {}).get("serving") or {}).items():
            say(f"  tuned batch {b}: {d['decision']}", flush=True)
    results = {b: latency_ms(engines, feeds_of(b), rounds, pause) for b in batches}
    say(f"\n{title}; medians of interleaved rounds (lower is better); ratio = latency / ORT's")
    header = f"{'engine':34s} {'build s':>8s} {'tune s':>7s}" + "".join(
        f" {'b' + str(b) + ' ms':>10s} {'ratio':>6s}" for b in batches
    )
    say(header)
    say("-" * len(header))
    table: dict = {}
    for name in engines:
        row = f"{name:34s} {build_s[name] - tune_s[name]:8.1f} {tune_s[name]:7.1f}"
        tuning = engines[name].manifest["backend"].get("metadata", {}).get("tuning") or {}
        table[name] = {
            "build_s": round(build_s[name] - tune_s[name], 2),
            "tune_s": round(tune_s[name], 2),
            "serving": tuning.get("serving"),
            "ms": {},
            "ratio": {},
        }
        for b in batches:
            ms = results[b][name]
            ratio = ms / results[b]["onnxruntime"]
            row += f" {ms:10.2f} {ratio:6.2f}"
            table[name]["ms"][b] = round(ms, 3)
            table[name]["ratio"][b] = round(ratio, 3)
        say(row)
    say(flush=True)
    if inspect is not None:
        inspect(engines)
    for engine in engines.values():
        engine.close()
    return table


#: (model, engine, the largest latency ratio to ONNX Runtime that meets the goal).
GOALS = (("cnn", "tvm NHWC", 1.0), ("bert", "tvm", 1.25))
#: The issue's CNN goal on corpus entries: untuned TVM at least as fast as ORT's default.
CORPUS_GOAL = ("tvm", 1.0)
#: The issue's tuning goal: tuned TVM >= 1.3x ORT's speed at batch 1 (a latency
#: ratio <= 1/1.3), the tuning within 20 minutes (pick --trials to fit).
TUNED_GOAL, TUNE_BUDGET_S = 1.3, 20 * 60
#: The issue's dynamic-shape goal: the transformer with only its symbolic module ("dynamic
#: only") at least 0.8x the speed of the untuned build with its static-shape modules, at every
#: batch size.
DYNAMIC_GOAL = ("bert", "tvm dynamic only", "tvm", 0.8)


def goals(report: dict) -> list[dict]:
    """Each goal with the measured worst ratio over the batch sizes and met / not met."""
    out = []
    corpus_goals = [(m, *CORPUS_GOAL) for m in report if m.startswith("corpus:")]
    for model, engine, limit in (*GOALS, *corpus_goals):
        if model not in report:
            continue
        row = report.get(model, {}).get(engine)
        worst = max(row["ratio"].values()) if row else None
        out.append(
            {
                "goal": f"{model}: {engine} latency <= {limit:g}x ONNX Runtime's",
                "worst_ratio": worst,
                "met": worst is not None and worst <= limit,
            }
        )
    model, dynamic, static, least = DYNAMIC_GOAL
    rows = report.get(model, {})
    if dynamic in rows and static in rows:
        # speed fraction = static latency / dynamic latency, the worst batch size
        worst = min(rows[static]["ms"][b] / ms for b, ms in rows[dynamic]["ms"].items())
        out.append(
            {
                "goal": f"{model}: {dynamic} >= {least:g}x the speed of {static} (static)",
                "worst_ratio": round(worst, 3),
                "met": worst >= least,
            }
        )
    for model, rows in report.items():
        for engine, row in rows.items() if model.startswith("corpus:") else ():
            if not engine.startswith("tvm tuned") or "1" not in map(str, row["ratio"]):
                continue
            ratio = row["ratio"].get(1, row["ratio"].get("1"))
            out.append(
                {
                    "goal": f"{model}: {engine} at batch 1 >= {TUNED_GOAL:g}x ONNX Runtime's "
                    f"speed, tuned within {TUNE_BUDGET_S // 60} minutes",
                    "worst_ratio": ratio,
                    "tune_s": row["tune_s"],
                    "met": ratio <= 1 / TUNED_GOAL and row["tune_s"] <= TUNE_BUDGET_S,
                }
            )
    return out


def _corpus_entry(
    name: str,
    batches: list[int],
    rounds: int,
    quiet: bool,
    tuned: dict | None = None,
    pause: float = PAUSE_S,
    roofline: dict | None = None,
) -> dict:
    """ORT vs untuned TVM on one corpus entry (its cached batch-dynamic ONNX export), and TVM
    tuned when ``tuned`` (the ``tune`` and ``tuning_db`` build options) is given. With
    ``roofline`` (a dict), the entry's ONNX path and its untuned TVM engine's per-kernel
    check at batch 1 are put there under ``"onnx"`` and ``"kernels"``."""
    import sys

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import corpus

    (entry,) = corpus.select([name])
    prepared = corpus.prepare(entry)
    base = prepared.samples[0].feeds
    top = max(batches)
    shapes = {n: [(1, *a.shape[1:]), (top, *a.shape[1:]), (top, *a.shape[1:])]
              for n, a in base.items()}  # fmt: skip
    feeds = {b: {n: np.repeat(a[:1], b, axis=0) for n, a in base.items()} for b in batches}
    configs: dict[str, dict] = {
        "onnxruntime": {"backend": "onnxruntime"},
        "tvm": {"backend": "tvm"},
    }
    if tuned:
        db = Path(tuned["tuning_db"]) / name  # one database per entry: its tasks and ledger
        configs[f"tvm tuned ({tuned['tune']['trials']} trials)"] = {
            "backend": "tvm",
            **tuned,
            "tuning_db": str(db),
        }
    inspect = None
    if roofline is not None:
        roofline["onnx"] = prepared.onnx
        if 1 in batches:
            inspect = partial(_inspect_kernels, roofline, feeds[1])
    return _run(
        f"corpus {name}", prepared.onnx, shapes, configs, lambda b: feeds[b], batches, rounds,
        quiet, pause, inspect,
    )  # fmt: skip


#: A kernel whose weights per call are at least this big is "late-stage" in the per-kernel
#: check: larger than a core's L2 (1 MiB on the hosts seen), so read from L3 or memory.
LATE_WEIGHT_BYTES = 1 << 20


def host_rates(times: int) -> dict:
    """The float32 matmul peak (GFLOP/s) and the memory read bandwidth (GB/s) measured
    ``times`` times each, alternating, with the load average before each pair."""
    from enginekit.evaluate.profile import matmul_peak
    from enginekit.evaluate.roofline import read_bandwidth

    out: dict = {"peak_gflops": [], "bandwidth_gbs": [], "loadavg": []}
    for _ in range(times):
        out["loadavg"].append(round(os.getloadavg()[0], 2))
        out["peak_gflops"].append(round(matmul_peak(), 1))
        out["bandwidth_gbs"].append(round(read_bandwidth(), 1))
    return out


def _kernel_weights(engine, feeds: dict) -> dict[str, int]:
    """Bytes of the weight argument (the second) of each conv2d/matmul kernel of a TVM engine,
    per call, by kernel symbol (one run of the VM with a call instrument)."""
    from tvm import relax
    from tvm.runtime.vm import VMInstrumentReturnKind

    from enginekit.backends import tvm as backend

    vm_engine = backend.load(engine.artifact, "cpu")
    try:
        vm = relax.VirtualMachine(vm_engine.library(feeds), vm_engine._dev)
        args = [vm_engine._to_tvm(np.asarray(feeds[n])) for n in vm_engine.program_inputs]
        weights: dict[str, int] = {}

        def instrument(func, symbol, before, ret, *call_args):
            kernel = "conv2d" in symbol or "matmul" in symbol or "dense" in symbol
            if before and kernel and len(call_args) >= 3:
                w = call_args[1]
                weights[symbol] = int(np.prod(w.shape)) * np.dtype(str(w.dtype)).itemsize
            return int(VMInstrumentReturnKind.NO_OP)

        vm.set_instrument(instrument)
        vm["main"](*args)
    finally:
        vm_engine.close()
    return weights


def _inspect_kernels(roof: dict, feeds: dict, engines: dict) -> None:
    """Per-kernel times of the untuned TVM engine (``enginekit profile``) with each conv/matmul
    kernel's weight bytes, into ``roof["kernels"]``."""
    import enginekit as ek

    engine = engines["tvm"]
    report = ek.profile(engine, feeds=feeds, runs=20, warmup=3)
    weights = _kernel_weights(engine, feeds)
    rows = [
        {"kernel": o.name, "calls": o.calls, "ms": o.ms, "gflop": o.gflop or 0.0,
         "weight_bytes": weights[o.name] * o.calls}
        for o in report.ops if o.name in weights
    ]  # fmt: skip
    roof["kernels"] = {"op_ms": report.op_ms, "infer_ms": report.infer_ms, "rows": rows}


def roofline_section(
    report: dict, roofs: dict, rates: dict, batches: list[int], cache: int | None = None
) -> list[str]:
    """The roofline lines: per model and batch the floors, each engine's latency as a multiple
    of the layer-serial floor, the batch-1 tuning goal against it, and the per-kernel check.
    Also puts the floors into ``report[model]["roofline"]``. ``cache``: the last-level cache
    size in bytes (default: this host's)."""
    from enginekit.evaluate.roofline import cache_bytes, costs, floors

    peak, bandwidth = max(rates["peak_gflops"]), max(rates["bandwidth_gbs"])
    medians = (statistics.median(rates["peak_gflops"]), statistics.median(rates["bandwidth_gbs"]))
    if cache is None:
        cache = cache_bytes() or 0
    lines = [
        f"roofline: float32 matmul peak {min(rates['peak_gflops']):.0f}-{peak:.0f} GFLOP/s, "
        f"read bandwidth {min(rates['bandwidth_gbs']):.1f}-{bandwidth:.1f} GB/s "
        f"({len(rates['peak_gflops'])} measurements each, load {min(rates['loadavg']):.2f}-"
        f"{max(rates['loadavg']):.2f}); floors use the best of each; last-level cache "
        f"{cache / 2**20:.0f} MiB"
    ]
    for model, roof in roofs.items():
        rows = report.get(model, {})
        out = report.setdefault(model, {}).setdefault("roofline", {}) if rows else {}
        for b in batches:
            cost = costs(roof["onnx"], shapes=roof.get("shapes", lambda b: None)(b), batch=b)
            f = floors(cost, peak, bandwidth, cache)
            out[b] = {"gflop": cost.flops / 1e9, "weight_mb": cost.weight_bytes / 1e6,
                      **f.to_json()}  # fmt: skip
            lines.append(
                f"{model} b{b}: {cost.flops / 1e9:.3f} GFLOP, weights {cost.weight_bytes / 1e6:.1f}"
                f" MB; floors: compute {f.compute_ms:.2f} ms, weights {f.weights_ms:.2f}, "
                f"layer-serial {f.serial_ms:.2f} (of which memory-bound nodes {f.bound_ms:.2f}), "
                f"cache-resident {f.resident_ms:.2f}"
                + (f"; {len(cost.unknown)} nodes uncounted" if cost.unknown else "")
            )
            for engine, row in rows.items():
                if engine == "roofline" or b not in row["ms"]:
                    continue
                ms = row["ms"][b]
                lines.append(
                    f"  {engine:32s} {ms:7.2f} ms = {ms / f.serial_ms:5.2f}x layer-serial floor, "
                    f"{ms / f.resident_ms:5.2f}x cache-resident"
                )
            if b == 1 and model.startswith("corpus:") and "onnxruntime" in rows:
                goal = rows["onnxruntime"]["ms"][b] / TUNED_GOAL
                out[b]["goal_ms"] = goal
                lines.append(
                    f"  {'goal (ORT / ' + format(TUNED_GOAL, 'g') + ')':32s} {goal:7.2f} ms = "
                    f"{goal / f.serial_ms:5.2f}x layer-serial floor, "
                    f"{goal / f.resident_ms:5.2f}x cache-resident"
                )
                if goal < f.resident_ms:
                    verdict = ("BELOW both floors: beyond this host even with ideal weight "
                               "caching")  # fmt: skip
                elif goal < f.serial_ms:
                    verdict = ("BELOW the layer-serial floor: beyond this host with layer-by-"
                               "layer execution that streams the weights every call; above the "
                               "cache-resident floor (only cross-call weight caching could reach "
                               "it)")  # fmt: skip
                else:
                    verdict = ("at or above the layer-serial floor: the roofline does not rule "
                               "it out")  # fmt: skip
                out[b]["goal_verdict"] = verdict
                lines.append(f"  goal: {verdict}")
                typical = floors(cost, *medians, cache)
                out[b]["median_rates"] = typical.to_json()
                lines.append(
                    f"  at the median rates ({medians[0]:.0f} GFLOP/s, {medians[1]:.1f} GB/s): "
                    f"layer-serial {typical.serial_ms:.2f} ms, cache-resident "
                    f"{typical.resident_ms:.2f}; the goal is {goal / typical.serial_ms:.2f}x and "
                    f"{goal / typical.resident_ms:.2f}x them"
                )
        kernels = roof.get("kernels")
        if kernels:
            lines += _kernel_lines(kernels, peak, bandwidth)
            out["kernels_b1"] = kernels
    return lines


def _kernel_lines(kernels: dict, peak: float, bandwidth: float) -> list[str]:
    """The per-kernel check: achieved weight GB/s of the late-stage kernels against the read
    bandwidth, and all conv/matmul kernels' time against their own floors."""
    rows = kernels["rows"]

    def floor_ms(r: dict) -> float:
        return max(r["gflop"] / peak, r["weight_bytes"] / 1e9 / bandwidth) * 1e3

    def totals(part: list[dict]) -> tuple[float, float, float, float]:
        """ms, MB of weights, GFLOP and floor ms of a group of kernels."""
        return (
            sum(r["ms"] for r in part), sum(r["weight_bytes"] for r in part) / 1e6,
            sum(r["gflop"] for r in part), sum(floor_ms(r) for r in part),
        )  # fmt: skip

    lines = [
        f"  tvm per kernel at b1 (enginekit profile, 20 runs): op time {kernels['op_ms']:.2f} ms,"
        f" infer {kernels['infer_ms']:.2f} ms"
    ]
    for label, part in (
        ("late-stage (weights >= 1 MiB a call)",
         [r for r in rows if r["weight_bytes"] / r["calls"] >= LATE_WEIGHT_BYTES]),
        ("early (weights < 1 MiB a call)",
         [r for r in rows if r["weight_bytes"] / r["calls"] < LATE_WEIGHT_BYTES]),
    ):  # fmt: skip
        if not part:
            continue
        ms, mb, gflop, floor = totals(part)
        lines.append(
            f"    {label}: {len(part)} kernels, {ms:.2f} ms, {mb:.1f} MB of weights -> "
            f"{mb / ms:.1f} GB/s ({mb / ms / bandwidth:.0%} of the read bandwidth), "
            f"{gflop / ms * 1e3:.0f} GFLOP/s ({gflop / ms * 1e3 / peak:.0%} of peak); "
            f"{ms / floor:.2f}x their floors ({floor:.2f} ms)"
        )
    # A kernel's GEMM rows (output pixels x batch) are its FLOPs over 2 x its weight elements
    # (4-byte weights): M = 4 is ResNet-50's layer4 at 64x64, 16 its layer3, 64 layer2.
    by_rows: dict[int, list[dict]] = {}
    for r in rows:
        if r["gflop"] and r["weight_bytes"]:
            m = round(r["gflop"] * 1e9 / (2 * r["weight_bytes"] / 4))
            by_rows.setdefault(m, []).append(r)
    for m, part in sorted(by_rows.items()):
        ms, mb, gflop, floor = totals(part)
        lines.append(
            f"    M = {m:5d} rows: {len(part):2d} kernels {ms:6.3f} ms, {mb:5.1f} MB -> "
            f"{mb / ms:5.1f} GB/s, {gflop / ms * 1e3:4.0f} GFLOP/s, {ms / floor:4.2f}x floors"
        )
    for r in sorted(rows, key=lambda r: -r["ms"])[:6]:
        lines.append(
            f"    {r['kernel'][:36]:36s} x{r['calls']:g} {r['ms']:6.3f} ms "
            f"{r['weight_bytes'] / 1e6:6.2f} MB {r['weight_bytes'] / 1e6 / r['ms']:5.1f} GB/s "
            f"{r['gflop'] / r['ms'] * 1e3:5.0f} GFLOP/s  {r['ms'] / floor_ms(r):5.2f}x floor"
        )
    return lines


def main() -> None:
    import torch

    import enginekit as ek
    from enginekit import target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--models", default="cnn,bert", help="cnn, bert, corpus (see --corpus); default cnn,bert"
    )
    ap.add_argument(
        "--corpus", default="tv-mobilenet_v3_small,tv-resnet50",
        help="corpus entries timed by --models corpus (default tv-mobilenet_v3_small,tv-resnet50)",
    )  # fmt: skip
    ap.add_argument("--size", type=int, default=64, help="CNN input height and width (default 64)")
    ap.add_argument("--seq", type=int, default=32, help="BERT sequence length (default 32)")
    ap.add_argument("--batches", default="1,16", help="batch sizes (default 1,16)")
    ap.add_argument(
        "--trials", type=int, default=0, help="tuning trials per batch (default 0: none)"
    )
    ap.add_argument("--tune-batches", help="batch sizes to tune with --trials (default: --batches)")
    ap.add_argument(
        "--tune-method", default="enginekit", choices=["enginekit", "metaschedule"],
        help="tuner for --trials (default enginekit: its schedule's candidates timed in the model)",
    )  # fmt: skip
    ap.add_argument(
        "--tuning-db",
        help="keep the tuning database here and reuse it (a rerun with the same trials runs "
        "none: it only compiles and times); default: a temporary directory",
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--pause", type=float, default=PAUSE_S,
        help=f"seconds between engines' blocks of calls, so that one engine's spinning threads "
        f"are idle when the next is timed (default {PAUSE_S}; 0: back to back)",
    )  # fmt: skip
    ap.add_argument(
        "--roofline", action="store_true",
        help="print each model's latency floors (FLOPs at the matmul peak, bytes at the "
        "measured read bandwidth; enginekit.evaluate.roofline), each engine's latency as a "
        "multiple of them, the batch-1 tuning goal against them, and (corpus, batch 1) the "
        "untuned TVM engine's per-kernel weight GB/s",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the results and goals as JSON")
    args = ap.parse_args()
    quiet = args.json
    say = (lambda *a, **k: None) if quiet else print
    bf16 = "avx512_bf16" in target.cpu_flags()
    report: dict = {"host": {"cpu": target.cpu_name(), "isa": sorted(target.cpu_flags())}}
    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)
    models = args.models.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="enginekit-bench-tvm-"))
    tune_batches = [int(b) for b in (args.tune_batches or args.batches).split(",")]
    tuning_db = Path(args.tuning_db) if args.tuning_db else tmp / "tvm-db"
    tuned = (
        {
            "tune": {
                "trials": args.trials,
                "batch_sizes": tune_batches,
                "method": args.tune_method,
            },
            "tuning_db": str(tuning_db),
        }
        if args.trials
        else None
    )
    say(f"host: {target.cpu_name()}, ISA {' '.join(sorted(target.cpu_flags()))}", flush=True)
    rates = host_rates(3) if args.roofline else None
    if rates:
        say(f"host rates before timing: {rates}", flush=True)
    roofs: dict = {}
    rng = np.random.default_rng(0)
    if "cnn" in models:
        path = ek.export(
            resnet(), (torch.randn(1, 3, args.size, args.size),), tmp / "resnet.onnx",
            dynamic_dims={"x": {0: "batch"}},
        )  # fmt: skip
        full = (top, 3, args.size, args.size)
        configs: dict[str, dict] = {
            "onnxruntime": {"backend": "onnxruntime"},
            "tvm NHWC": {"backend": "tvm", "layout": "NHWC"},
            "tvm NCHW": {"backend": "tvm", "layout": "NCHW"},
        }
        if bf16:
            configs["tvm NHWC bf16"] = {"backend": "tvm", "layout": "NHWC", "precision": "bf16"}
        if args.trials:
            configs[f"tvm NHWC tuned ({args.trials} trials)"] = {
                "backend": "tvm",
                "layout": "NHWC",
                **tuned,
                "tuning_db": str(tuning_db / "cnn"),
            }
        images = {
            b: rng.standard_normal((b, 3, args.size, args.size)).astype(np.float32) for b in batches
        }
        report["cnn"] = _run(
            f"ResNet-style CNN, {args.size}x{args.size} inputs", path,
            {"x": [(1, 3, args.size, args.size), full, full]}, configs,
            lambda b: {"x": images[b]}, batches, args.rounds, quiet, args.pause,
        )  # fmt: skip
        roofs["cnn"] = {"onnx": path}
    if "corpus" in models:
        for name in args.corpus.split(","):
            roof: dict | None = {} if args.roofline else None
            report[f"corpus:{name}"] = _corpus_entry(
                name, batches, args.rounds, quiet, tuned, args.pause, roof
            )
            if roof is not None:
                roofs[f"corpus:{name}"] = roof
    encoder = bert() if "bert" in models else None
    if "bert" in models and encoder is None:
        say("bert: skipped (pip install transformers)")
    if encoder is not None:
        ids = torch.randint(0, 1000, (2, args.seq))
        path = ek.export(
            encoder, (ids,), tmp / "bert.onnx", dynamic_batch=True,
            dynamic_dims={"input_ids": {1: "seq"}},
        )  # fmt: skip
        shapes = {"input_ids": [(1, 1), (top, args.seq), (top, args.seq)]}
        tokens = {b: rng.integers(0, 1000, (b, args.seq)) for b in batches}
        bert_configs: dict[str, dict] = {
            "onnxruntime": {"backend": "onnxruntime"},
            "tvm": {"backend": "tvm"},
            "tvm dynamic only": {"backend": "tvm", "specialize": False},
        }
        if bf16:
            bert_configs["tvm bf16"] = {"backend": "tvm", "precision": "bf16"}
        report["bert"] = _run(
            f"BERT (hidden 128, 2 layers, 4 heads), sequence {args.seq}", path, shapes,
            bert_configs, lambda b: {"input_ids": tokens[b]}, batches, args.rounds, quiet,
            args.pause,
        )  # fmt: skip
        roofs["bert"] = {"onnx": path, "shapes": lambda b: {"input_ids": (b, args.seq)}}
    if rates:
        after = host_rates(2)
        say(f"host rates after timing: {after}", flush=True)
        rates = {k: rates[k] + after[k] for k in rates}
        report["host"]["rates"] = rates
        lines = roofline_section(report, roofs, rates, batches)
        say("\n".join(lines) + "\n", flush=True)
    report["goals"] = goals(report)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("goals")
    for g in report["goals"]:
        worst = "-" if g["worst_ratio"] is None else f"{g['worst_ratio']:.2f}"
        print(f"  {g['goal']:52s} worst {worst:>5s}  {'met' if g['met'] else 'not met'}")
    if not bf16:
        print("  (no bf16 rows: this CPU has no AVX512-BF16)")


if __name__ == "__main__":
    main()
