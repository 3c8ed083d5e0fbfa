"""Throughput of every available backend relative to plain ONNX Runtime, on a ResNet-style CNN.

One run measures, side by side and interleaved in rounds:
- plain ONNX Runtime: an InferenceSession with default SessionOptions, ``session.run``;
- every registered enginekit backend available here (picked up from the registry), built with
  its default options (or ``-O backend.key=value``) at a fixed batch of 1 and of 32;
- this machine's float32 matmul peak (numpy, and torch when installed; the higher counts).

It prints samples/s, the ratio to plain ONNX Runtime, and the achieved GFLOP/s as a fraction of
the measured peak; the model's FLOPs are counted from the ONNX graph (Conv, Gemm, MatMul).

    python benchmarks/backends.py                      # batch 1 and 32, 2 s per contender
    python benchmarks/backends.py --duration 5 --json results.json -O BACKEND.KEY=VALUE
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import enginekit as ek
from enginekit import backends as registry
from enginekit.evaluate.bench import UNSTABLE_SPREAD, spread, time_calls
from enginekit.evaluate.machine import host_info

# -- the model ----------------------------------------------------------------------------------


class _Graph:
    """A tiny builder: conv/relu/add nodes with He-initialized weights."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(0)
        self.n = 0

    def name(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"

    def conv(
        self, x: str, cin: int, cout: int, k: int = 3, stride: int = 1, relu: bool = True
    ) -> str:
        w, b, y = self.name("w"), self.name("b"), self.name("conv")
        scale = np.sqrt(2.0 / (cin * k * k))
        self.inits.append(
            numpy_helper.from_array(
                (self.rng.standard_normal((cout, cin, k, k)) * scale).astype(np.float32), w
            )
        )
        self.inits.append(numpy_helper.from_array(np.zeros(cout, np.float32), b))
        pad = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, w, b],
                [y],
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad] * 4,
            )
        )
        return self.relu(y) if relu else y

    def relu(self, x: str) -> str:
        y = self.name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [y]))
        return y

    def block(self, x: str, cin: int, cout: int, stride: int) -> str:
        """A ResNet basic block: conv-relu-conv plus a (projected) skip, then relu."""
        h = self.conv(x, cin, cout, 3, stride)
        h = self.conv(h, cout, cout, 3, 1, relu=False)
        skip = x if stride == 1 and cin == cout else self.conv(x, cin, cout, 1, stride, relu=False)
        y = self.name("add")
        self.nodes.append(helper.make_node("Add", [h, skip], [y]))
        return self.relu(y)


def resnet_style(image: int = 64, classes: int = 100) -> onnx.ModelProto:
    """Stem conv, three stages of basic blocks (32, 64, 128 channels), pool, Gemm."""
    g = _Graph()
    h = g.conv("x", 3, 32, 3, 2)
    for cin, cout, stride in ((32, 32, 1), (32, 32, 1), (32, 64, 2), (64, 64, 1),
                              (64, 128, 2), (128, 128, 1)):  # fmt: skip
        h = g.block(h, cin, cout, stride)
    g.nodes.append(helper.make_node("GlobalAveragePool", [h], ["pooled"]))
    g.nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"]))
    fc = (g.rng.standard_normal((classes, 128)) / np.sqrt(128)).astype(np.float32)
    g.inits.append(numpy_helper.from_array(fc, "fc_w"))
    g.inits.append(numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b"))
    g.nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1))
    graph = helper.make_graph(
        g.nodes,
        "resnet_style",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, image, image])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", classes])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# -- FLOPs ----------------------------------------------------------------------------------------


def count_flops(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]]) -> int:
    """FLOPs (multiply and add counted as 2) of Conv, Gemm and MatMul at concrete input shapes."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for v in fixed.graph.input:
        if v.name in input_shapes:
            dims = v.type.tensor_type.shape.dim
            for d, size in zip(dims, input_shapes[v.name]):
                d.Clear()
                d.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(fixed, strict_mode=True)
    shapes: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in inferred.graph.initializer}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shapes[v.name] = tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
    total = 0
    for node in inferred.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv":
            w, out = shapes[node.input[1]], shapes[node.output[0]]
            total += 2 * int(np.prod(out)) * int(np.prod(w[1:]))  # w[1] is Cin / group
        elif node.op_type == "Gemm":
            a = shapes[node.input[0]]
            b = shapes[node.input[1]]
            m, k = (a[1], a[0]) if attrs.get("transA", 0) else a
            n = b[0] if attrs.get("transB", 0) else b[1]
            total += 2 * m * n * k
        elif node.op_type == "MatMul":
            a, out = shapes[node.input[0]], shapes[node.output[0]]
            total += 2 * int(np.prod(out)) * a[-1]
    return total


# -- the machine's peak ---------------------------------------------------------------------------


def matmul_peak(n: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """Best float32 matmul GFLOP/s over numpy and torch (when installed); and which one."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    flops = 2 * n**3
    best = {"numpy": flops / min(time_calls(lambda: a @ b, None, repeats)) / 1e9}
    try:
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        torch.mm(ta, tb)
        best[f"torch ({torch.get_num_threads()} threads)"] = (
            flops / min(time_calls(lambda: torch.mm(ta, tb), None, repeats)) / 1e9
        )
    except ImportError:
        pass
    which = max(best, key=lambda k: best[k])
    return best[which], f"{which}; " + ", ".join(f"{k} {v:.1f}" for k, v in best.items())


# -- contenders -----------------------------------------------------------------------------------


def plain_ort(model: onnx.ModelProto) -> Any:
    """``session.run`` on an InferenceSession with default options: the baseline."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def backend_options(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``-O backend.key=value`` flags as backend -> options (values parsed as JSON when JSON)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        key, _, raw = spec.partition("=")
        backend, _, option = key.partition(".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(backend, {})[option] = value
    return out


def contenders(
    model: onnx.ModelProto, batch: int, image: int, options: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """label -> callable(feeds) for plain ORT and every available backend; label -> why not."""
    fns = {"onnxruntime (plain session)": plain_ort(model)}
    skipped = {}
    shape = (batch, 3, image, image)
    for name in registry.names():
        avail = registry.availability(name)
        if not avail.available or "cpu" not in avail.devices:
            skipped[name] = avail.reason or f"no cpu device ({avail.devices})"
            continue
        start = time.perf_counter()
        try:
            engine = ek.build(model, backend=name, shapes={"x": shape}, **options.get(name, {}))
        except ek.EnginekitError as exc:
            skipped[name] = f"build failed: {exc}"
            continue
        print(f"  built {name} at batch {batch} in {time.perf_counter() - start:.1f} s", flush=True)
        fns[f"{name} (enginekit)"] = engine.infer
    return fns, skipped


def measure(
    fns: dict[str, Any], feeds: dict[str, np.ndarray], duration: float, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each contender, rounds interleaved; returns per-round mean seconds."""
    for fn in fns.values():
        time_calls(lambda fn=fn: fn(feeds), 0.3, None)  # warm-up
    per_round: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            times = time_calls(lambda fn=fn: fn(feeds), duration / rounds, None)
            per_round[label].append(float(times.mean()))
    return per_round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--image", type=int, default=64, help="input height and width")
    p.add_argument("--duration", type=float, default=2.0, help="timed seconds per contender")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-O", "--option", action="append", default=[], metavar="BACKEND.KEY=VALUE")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    model = resnet_style(args.image)
    peak, peak_how = matmul_peak()
    host = host_info()
    print(f"host: {host.get('cpu')}, {host.get('cpus')} CPUs, load {host.get('loadavg')}")
    print(f"float32 matmul peak: {peak:.1f} GFLOP/s ({peak_how})")
    rows = []
    for batch in batches:
        flops = count_flops(model, {"x": (batch, 3, args.image, args.image)})
        print(f"\nResNet-style CNN, batch {batch}: {flops / batch / 1e6:.1f} MFLOP per sample")
        fns, skipped = contenders(model, batch, args.image, backend_options(args.option))
        feeds = {"x": np.random.default_rng(0).standard_normal(
            (batch, 3, args.image, args.image)).astype(np.float32)}  # fmt: skip
        per_round = measure(fns, feeds, args.duration, args.rounds)
        base = batch / float(np.median(per_round["onnxruntime (plain session)"]))
        print(f"{'contender':<30} {'samples/s':>10} {'vs ORT':>7} {'GFLOP/s':>8} {'of peak':>8} "
              f"{'spread':>7}")  # fmt: skip
        for label, seconds in per_round.items():
            rate = batch / float(np.median(seconds))
            gflops = flops / float(np.median(seconds)) / 1e9
            s = spread([batch / t for t in seconds])
            rows.append({"batch": batch, "contender": label, "samples_per_s": rate,
                         "relative_to_plain_ort": rate / base, "gflops": gflops,
                         "fraction_of_peak": gflops / peak, "spread": s})  # fmt: skip
            print(f"{label:<30} {rate:>10.1f} {rate / base:>6.2f}x {gflops:>8.1f} "
                  f"{gflops / peak:>7.1%} {'-' if s is None else f'{s:.0%}':>7}")  # fmt: skip
        for name, why in skipped.items():
            print(f"{name + ' (enginekit)':<30} skipped: {why}")
            rows.append({"batch": batch, "contender": name, "skipped": why})
    noisy = [r for r in rows if (r.get("spread") or 0.0) > UNSTABLE_SPREAD]
    if noisy:
        print(
            f"\nnote: {len(noisy)} result(s) vary by more than {UNSTABLE_SPREAD:.0%} between rounds "
            f"(load {host.get('loadavg')}); re-run on a quiet machine or with a longer --duration"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"host": host, "peak_gflops": peak, "peak": peak_how, "rows": rows}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
