"""Engine.infer overhead vs a raw onnxruntime.InferenceSession.run, and IO binding vs plain run.

Prints ratios measured side by side in one run (interleaved rounds, median of per-round ratios):

    python benchmarks/overhead.py [--rounds 30] [--calls 2000]

Goal: Engine.infer / InferenceSession.run <= 1.03 on a tiny MLP at batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import enginekit as ek


def tiny_mlp() -> onnx.ModelProto:
    """x[batch,16] -> 32 -> relu -> 4: the smallest model where overhead shows."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def side_by_side(
    fns: dict[str, Callable[[], object]], rounds: int, calls: int, block: int = 20
) -> dict[str, list[float]]:
    """Per-call ns of each function per round; functions alternate in blocks of ``block`` calls
    so that every side sees the same machine conditions (other load, frequency changes)."""
    for fn in fns.values():  # warm up
        per_call(fn, calls // 10 + 1)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        total = dict.fromkeys(fns, 0.0)
        for _ in range(max(calls // block, 1)):
            for name, fn in fns.items():
                total[name] += per_call(fn, block) * block
        for name in fns:
            times[name].append(total[name] / (max(calls // block, 1) * block))
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of time(a)/time(b)."""
    r = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(r), min(r), max(r)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()

    model = tiny_mlp()
    # One intra-op thread: at batch 1 a thread pool only adds spin-wait noise on a small machine,
    # and both sides of each ratio share the same session and settings.
    shapes = {"x": [(1, 16), (64, 16), (64, 16)]}
    engine = ek.build(model, shapes=shapes, verify=False, intra_op_threads=1)
    bound = ek.build(model, shapes=shapes, verify=False, intra_op_threads=1, io_binding=True)
    session = engine.session
    print(
        f"onnxruntime {engine.manifest['backend']['version']}, tiny MLP 16-32-4, 1 intra-op thread"
    )

    x1 = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    times = side_by_side(
        {
            "raw": lambda: session.run(["y"], {"x": x1}),
            "engine": lambda: engine.infer({"x": x1}),
            "engine_array": lambda: engine.infer(x1),
        },
        args.rounds,
        args.calls,
    )
    med = {k: statistics.median(v) / 1e3 for k, v in times.items()}
    r, lo, hi = ratio(times, "engine", "raw")
    print(
        f"batch 1: InferenceSession.run {med['raw']:.2f} us, Engine.infer(dict) {med['engine']:.2f} us, Engine.infer(array) {med['engine_array']:.2f} us"
    )
    print(
        f"Engine.infer / InferenceSession.run = {r:.3f}x (rounds: {lo:.3f}..{hi:.3f}); goal <= 1.03 -> {'met' if r <= 1.03 else 'MISSED'}"
    )
    r2, lo2, hi2 = ratio(times, "engine_array", "raw")
    print(
        f"Engine.infer(single array) / InferenceSession.run = {r2:.3f}x (rounds: {lo2:.3f}..{hi2:.3f})"
    )

    for batch in (1, 64):
        xb = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
        t = side_by_side(
            {"plain": lambda xb=xb: engine.infer(xb), "iobinding": lambda xb=xb: bound.infer(xb)},
            args.rounds,
            max(args.calls // 2, 1),
        )
        rb, lob, hib = ratio(t, "iobinding", "plain")
        print(
            f"batch {batch}: IO binding / plain run = {rb:.3f}x (rounds: {lob:.3f}..{hib:.3f}); "
            f"plain {statistics.median(t['plain']) / 1e3:.2f} us, bound {statistics.median(t['iobinding']) / 1e3:.2f} us"
        )


if __name__ == "__main__":
    main()
