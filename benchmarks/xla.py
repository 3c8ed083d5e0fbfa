"""XLA backend vs ONNX Runtime: real models at fp32/bf16/fp16, and layouts on a ResNet-style CNN.

Prints, in one run, side by side (the host's CPU and ISA flags first):
  0. ``--part real`` (default: all parts): torchvision ResNet-18 and a small BERT (transformers,
     random weights) at batch 1 and 16: ONNX Runtime's default session, XLA at fp32, bf16 and
     fp16, median latency and speed vs ONNX Runtime, and bf16/fp16 error vs fp32 XLA (max abs
     error relative to the output's largest magnitude);
  1. ``--part layouts``: median latency at batch 1 and 32 of ONNX Runtime (default session) and
     of the XLA engine for each layout (nhwc, nchw) and XLA option set (xla-default, ynn-off);
  2. what `layout=auto, xla_flags=auto` picks at build time;
  3. compile seconds per batch bucket (1, 2, 4, ..., 32) of one engine fed batches 1..32.

    python benchmarks/xla.py [--part real|layouts|all] [--size 64] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import enginekit as ek

BATCHES = (1, 32)


def resnet(width: int = 32):
    """A small ResNet: stem, three stages of two basic blocks, global pool, FC (BN folds on export)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))

    torch.manual_seed(0)
    layers = [nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers).eval()


def interleaved_ms(
    engines: dict[str, ek.Engine], x: np.ndarray, seconds: float, rounds: int = 7
) -> dict[str, float]:
    """Median per-call milliseconds, measured round-robin so load spikes hit every engine alike."""
    per_call = {}
    for label, engine in engines.items():
        engine.infer(x)
        start = time.perf_counter()
        engine.infer(x)
        per_call[label] = time.perf_counter() - start
    budget = seconds / rounds
    reps = {label: max(1, int(budget / max(t, 1e-6))) for label, t in per_call.items()}
    samples: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, engine in engines.items():
            start = time.perf_counter()
            for _ in range(reps[label]):
                engine.infer(x)
            samples[label].append((time.perf_counter() - start) / reps[label])
    return {label: statistics.median(v) * 1e3 for label, v in samples.items()}


REAL_BATCHES = (1, 16)
PRECISIONS = ("fp32", "bf16", "fp16")


def real_models(work: Path, size: int) -> dict[str, tuple[Path, dict, dict[int, dict]]]:
    """ResNet-18 (torchvision) and a 4-layer BERT (transformers): path, shapes, feeds by batch."""
    import torch
    import transformers

    lib = torch.library.Library("torchvision", "DEF")  # torchvision's CUDA-built ops need these
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    top = max(REAL_BATCHES)
    found: dict[str, tuple[Path, dict, dict[int, dict]]] = {}
    cnn = torchvision.models.resnet18(weights=None).eval()
    path = ek.export(
        cnn, (torch.randn(1, 3, size, size),), work / "resnet18.onnx", dynamic_batch=True
    )
    name = ek.load_model(path).inputs[0].name
    image = (3, size, size)
    found[f"resnet18 {size}x{size}"] = (
        path,
        {name: [(1, *image), (top, *image), (top, *image)]},
        {b: {name: rng.standard_normal((b, *image)).astype(np.float32)} for b in REAL_BATCHES},
    )

    class Bert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(
                vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=1024,
            )  # fmt: skip
            self.bert = transformers.BertModel(config).eval()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    seq = 64
    ids = torch.randint(0, 1000, (2, seq))
    path = ek.export(
        Bert(),
        (ids, torch.ones_like(ids)),
        work / "bert.onnx",
        dynamic_batch=True,
        dynamic_dims={"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}},
    )
    found[f"bert 4x256 seq {seq}"] = (
        path,
        {n: [(1, 1), (top, seq), (top, 128)] for n in ("input_ids", "attention_mask")},
        {
            b: {
                "input_ids": rng.integers(0, 1000, (b, seq)).astype(np.int64),
                "attention_mask": np.ones((b, seq), np.int64),
            }
            for b in REAL_BATCHES
        },
    )
    return found


def run_real(work: Path, size: int, seconds: float) -> None:
    """Part 0: real models, ONNX Runtime vs XLA at each precision, speed and error."""
    for label, (path, shapes, feeds) in real_models(work, size).items():
        engines: dict[str, ek.Engine] = {
            "onnxruntime": ek.build(path, backend="onnxruntime", shapes=shapes, verify=False)
        }
        for precision in PRECISIONS:
            engines[f"xla {precision}"] = ek.build(
                path, backend="xla", shapes=shapes, precision=precision, xla_flags="auto"
            )
        print(f"\n{label}")
        print(f"{'engine':<16}" + "".join(f"{f'b{b} ms':>10}{'vs ORT':>9}" for b in REAL_BATCHES)
              + f"{'err vs fp32':>14}")  # fmt: skip
        by_batch = {
            b: interleaved_ms(engines, feeds[b], seconds * len(engines)) for b in REAL_BATCHES
        }
        reference = engines["xla fp32"].infer(feeds[REAL_BATCHES[-1]])
        for name, engine in engines.items():
            cells = "".join(
                f"{by_batch[b][name]:>10.2f}{by_batch[b]['onnxruntime'] / by_batch[b][name]:>8.2f}x"
                for b in REAL_BATCHES
            )
            error = ""
            if name.startswith("xla") and name != "xla fp32":
                got = engine.infer(feeds[REAL_BATCHES[-1]])
                error = "  " + ", ".join(
                    f"{np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30):.2e}"
                    for k, v in reference.items()
                )
            print(f"{name:<16}{cells}{error}")
        for engine in engines.values():
            engine.close()


def main(argv: list[str] | None = None) -> None:
    import torch

    from enginekit import target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("real", "layouts", "all"), default="all")
    parser.add_argument("--size", type=int, default=64, help="input height and width")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per measurement")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="enginekit-bench-xla-"))
    flags = target.cpu_flags()
    isa = [
        f
        for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx512_fp16")
        if f in flags
    ]
    print(f"host: {target.cpu_name()}, ISA: {' '.join(isa) or 'none of avx2/avx512'}")
    if args.part in ("real", "all"):
        run_real(work, args.size, args.seconds)
    if args.part in ("layouts", "all"):
        run_layouts(work, args.size, args.seconds, torch)


def run_layouts(work: Path, size: int, seconds: float, torch: Any) -> None:
    """Parts 1-3: layouts and XLA option sets on the ResNet-style CNN, auto's pick, buckets."""

    shape = (3, size, size)
    path = ek.export(resnet(), (torch.randn(1, *shape),), work / "resnet.onnx", dynamic_batch=True)
    shapes = {"input": [(1, *shape), (32, *shape), (32, *shape)]}
    name = ek.load_model(path).inputs[0].name
    shapes = {name: shapes["input"]}
    rng = np.random.default_rng(0)
    feeds = {b: rng.standard_normal((b, *shape)).astype(np.float32) for b in BATCHES}

    print(f"ResNet-style CNN, input {size}x{size}, {torch.get_num_threads()} threads")
    engines: dict[str, ek.Engine] = {
        "onnxruntime (default)": ek.build(path, backend="onnxruntime", shapes=shapes, verify=False)
    }
    for layout in ("nhwc", "nchw"):
        for flags in ("xla-default", "ynn-off"):
            engines[f"xla {layout} {flags}"] = ek.build(
                path, backend="xla", shapes=shapes, verify=False, layout=layout, xla_flags=flags
            )
    by_batch = {b: interleaved_ms(engines, feeds[b], seconds * len(engines)) for b in BATCHES}
    rows = {label: {b: by_batch[b][label] for b in BATCHES} for label in engines}
    for engine in engines.values():
        engine.close()

    base = rows["onnxruntime (default)"]
    print(f"\n{'engine':<28}" + "".join(f"{f'batch {b} ms':>14}{'vs ORT':>9}" for b in BATCHES))
    for label, ms in rows.items():
        cells = "".join(f"{ms[b]:>14.3f}{base[b] / ms[b]:>8.2f}x" for b in BATCHES)
        print(f"{label:<28}{cells}")
    for b in BATCHES:
        nhwc = min(rows[f"xla nhwc {f}"][b] for f in ("xla-default", "ynn-off"))
        nchw = min(rows[f"xla nchw {f}"][b] for f in ("xla-default", "ynn-off"))
        print(f"batch {b}: best NHWC is {nchw / nhwc:.2f}x the speed of best NCHW")

    start = time.perf_counter()
    auto = ek.build(path, backend="xla", shapes=shapes, output=work / "auto.ekit", layout="auto")
    meta = auto.manifest["backend"]["metadata"]
    print(
        f"\nlayout=auto, xla_flags=auto: built in {time.perf_counter() - start:.1f} s, picked "
        f"{meta['layout']} / {meta['xla_flags']} {meta['compiler_options']}"
    )
    for trial in meta["tuning"]:
        print(
            f"  {trial['layout']:<5} {trial['flags']:<12} {trial['ms']:>9.3f} ms "
            f"(compile {trial['compile_s']:.2f} s)"
        )
    auto.close()

    engine = ek.load(work / "auto.ekit")
    x = rng.standard_normal((32, *shape)).astype(np.float32)
    for b in range(1, 33):
        engine.infer(x[:b])
    print(f"\nbatches 1..32 compiled {len(engine.programs)} programs (log2(32)+1 = 6):")
    for key, seconds in engine.programs.items():
        print(f"  {key:<16} {seconds:.2f} s")
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
