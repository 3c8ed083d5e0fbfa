"""bf16 for the layers accuracy-aware int8 keeps in float, on OpenVINO: the same Q/DQ plans
compiled with the f32 and the bf16 inference precision hint, on a real-weight model and real
photos (the models and crops of ``benchmarks/int8_accuracy.py``).

    python benchmarks/int8_bf16.py [--model mobilenet_v2|efficientnet_lite0]
                                   [--calib 96] [--test 200] [--batch 8] [--rounds 5]

Plans (fixed, so f32 and bf16 run the same layers in float): all-int8, first 2 and last 2
layers float, every 2nd layer float, 3 of every 4 layers float; plus the fp32 model under both
hints. Prints per engine its top-1 agreement with fp32 (f32 hint) on the test crops, ms per
batch (median of interleaved rounds, all engines alike), speed vs fp32, and which kernels the
CPU plugin picked for the convolutions (runtime precision: u8/i8 = int8, bf16, f32), with the
load average before and after. Needs a CPU with native bf16 (AVX512-BF16 or AMX) for bf16 to
mean anything: elsewhere OpenVINO computes the bf16 hint in f32.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import int8_accuracy as real

import enginekit as ek
from enginekit import target
from enginekit.calibration.fallback import keep_float, quantized_nodes
from enginekit.calibration.writers import write_qdq
from enginekit.errors import UsageError, did_you_mean


def plans(layers: list[str]) -> dict[str, list[str]]:
    return {
        "all-int8": [],
        "first2+last2 float": layers[:2] + layers[-2:],
        "every 2nd float": layers[::2],
        "3 of 4 float": [name for i, name in enumerate(layers) if i % 4],
    }


def compile_(core: Any, proto: Any, precision: str) -> Any:
    import openvino as ov
    import openvino.properties.hint as hints

    config = {
        hints.performance_mode: hints.PerformanceMode.LATENCY,
        hints.inference_precision: getattr(ov.Type, precision),
        hints.execution_mode: hints.ExecutionMode.PERFORMANCE,
    }
    return core.compile_model(core.read_model(proto.SerializeToString()), "CPU", config)


def conv_kernels(compiled: Any) -> dict[str, int]:
    """Convolutions of the compiled graph counted by runtime precision."""
    count: collections.Counter[str] = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if rt["layerType"].astype(str) in ("Convolution", "FullyConnected"):
            count[rt["runtimePrecision"].astype(str)] += 1
    return dict(sorted(count.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="mobilenet_v2", help=", ".join(real.MODELS))
    ap.add_argument("--calib", type=int, default=96, help="calibration crops (entropy ranges)")
    ap.add_argument("--test", type=int, default=200, help="test crops (agreement)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    args = ap.parse_args()
    if args.model not in real.MODELS:
        raise UsageError(
            f"--model {args.model!r}: expected one of {', '.join(real.MODELS)}"
            + did_you_mean(args.model, real.MODELS)
        )
    import onnx
    import openvino as ov

    flags = target.cpu_flags()
    print(f"host ISA: {' '.join(sorted(f for f in flags if 'bf16' in f or 'vnni' in f))}")
    print(f"openvino {ov.get_version()}; load {Path('/proc/loadavg').read_text().strip()}")
    model = real.MODELS[args.model]
    images = real.photos()
    calib = model.normalize(real.crops(images, args.calib, seed=1))
    test = model.normalize(real.crops(images, args.test, seed=2))
    with tempfile.TemporaryDirectory() as tmp:
        path = real.export(model, Path(tmp) / "model.onnx")
        source = onnx.load(str(path))
        table = ek.calibrate(str(path), calib, method="entropy")
    qdq = write_qdq(source, table, style="onnxruntime-cpu", per_channel=True, reduce_range=False)
    layers = quantized_nodes(qdq)
    core = ov.Core()
    engines: dict[str, Any] = {}
    for precision in ("f32", "bf16"):
        engines[f"fp32 model, {precision} hint"] = compile_(core, source, precision)
    for name, keep in plans(layers).items():
        proto = keep_float(qdq, source, keep)
        for precision in ("f32", "bf16"):
            key = f"{name} ({len(keep)}/{len(layers)}), {precision} hint"
            engines[key] = compile_(core, proto, precision)

    def top1(compiled: Any) -> np.ndarray:
        request = compiled.create_infer_request()
        out = compiled.output(0)
        return np.concatenate(
            [
                request.infer({0: test[i : i + args.batch]})[out].argmax(1)
                for i in range(0, len(test), args.batch)
            ]
        )

    reference = top1(engines["fp32 model, f32 hint"])
    x = test[: args.batch]
    requests = {key: c.create_infer_request() for key, c in engines.items()}
    for request in requests.values():
        request.infer({0: x})
    times: dict[str, list[float]] = {key: [] for key in engines}
    for _ in range(args.rounds):  # interleaved: load changes hit every engine alike
        for key, request in requests.items():
            best = []
            for _ in range(3):
                start = time.perf_counter()
                request.infer({0: x})
                best.append(time.perf_counter() - start)
            times[key].append(min(best))
    base = statistics.median(times["fp32 model, f32 hint"])
    print(f"\n{args.model}, batch {args.batch}, {args.test} test crops:")
    print(f"{'engine':<40} {'top-1 agree':>11} {'ms/batch':>9} {'vs fp32':>8}  conv kernels")
    for key, compiled in engines.items():
        agree = float((top1(compiled) == reference).mean())
        ms = statistics.median(times[key])
        kernels = conv_kernels(compiled)
        print(f"{key:<40} {agree:>10.1%} {ms * 1e3:>9.1f} {base / ms:>7.2f}x  {kernels}")
    print(f"\nload {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
