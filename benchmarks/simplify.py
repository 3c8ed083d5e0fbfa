"""Graph simplifiers side by side on the test models: node count, time, output equality.

    python benchmarks/simplify.py [--tf]

Rows: onnxslim (what enginekit's build runs), Polygraphy's constant folding (needs
onnx-graphsurgeon, which Polygraphy does not install), and ONNX Runtime's own basic-level graph
optimizations saved offline (for context: ORT re-does those at session creation anyway).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import enginekit as ek  # noqa: E402
from enginekit import passes  # noqa: E402
from enginekit.model import concrete_shapes, random_feeds, reference_session  # noqa: E402


def foldable() -> onnx.ModelProto:
    """Constants to fold, a shape computation on constants, a dead branch, a no-op chain."""
    rng = np.random.default_rng(0)
    a = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32))
    nodes = [
        helper.make_node("Constant", [], ["a"], value=a),
        helper.make_node("Mul", ["a", "a"], ["a2"]),
        helper.make_node("Add", ["a2", "a"], ["bias"]),
        helper.make_node("Identity", ["bias"], ["bias1"]),
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "bias1"], ["hb"]),
        helper.make_node("Shape", ["W"], ["ws"]),
        helper.make_node("Reshape", ["hb", "ws_neg"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
        helper.make_node("Neg", ["a"], ["dead"]),
    ]
    w = numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "W")
    shape = numpy_helper.from_array(np.array([-1, 64], np.int64), "ws_neg")
    graph = helper.make_graph(
        nodes,
        "foldable",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        [w, shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def torch_models(directory: Path) -> dict[str, onnx.ModelProto]:
    try:
        from models import CASES, export_case
    except ImportError:
        return {}
    return {f"torch-{n}": onnx.load(export_case(n, directory)) for n in CASES}


def tf_models(directory: Path) -> dict[str, onnx.ModelProto]:
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    cnn = keras.Sequential(
        [
            keras.Input((16, 16, 3), name="image"),
            layers.Conv2D(8, 3, activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, activation="relu"),
            layers.Flatten(),
            layers.Dense(10),
        ]
    )
    return {"keras-cnn": onnx.load(ek.export(cnn, None, directory / "keras-cnn.onnx"))}


def run_onnxslim(model: onnx.ModelProto) -> onnx.ModelProto:
    return passes.simplify(model)


def run_polygraphy(model: onnx.ModelProto) -> onnx.ModelProto:
    from polygraphy.backend.onnx import fold_constants
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR  # it prints a line per folding pass
    return fold_constants(model, num_passes=None, do_shape_inference=True, copy=True)


def run_ort_basic(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(Path(d) / "out.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def polygraphy_usable() -> str | None:
    try:
        import onnx_graphsurgeon  # noqa: F401
        import polygraphy  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def max_diff(a: onnx.ModelProto, b: onnx.ModelProto) -> float:
    ma, mb = ek.load_model(a), ek.load_model(b)
    feeds = random_feeds(ma.inputs, concrete_shapes(ma.inputs, None, batch=3, dims={"seq": 5}))
    names = [o.name for o in ma.outputs]
    ra = reference_session(ma).run(names, feeds)
    rb = reference_session(mb).run(names, feeds)
    return max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(ra, rb))


def measure(fn: Callable[[onnx.ModelProto], onnx.ModelProto], model: onnx.ModelProto):
    fn(model)  # warm (first-call imports)
    times, out = [], model
    for _ in range(3):
        start = time.perf_counter()
        out = fn(model)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tf", action="store_true", help="add a Keras model (imports TF)")
    args = parser.parse_args()
    tools: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {"onnxslim": run_onnxslim}
    why = polygraphy_usable()
    if why is None:
        tools["polygraphy"] = run_polygraphy
    else:
        print(f"# polygraphy fold_constants skipped: {why}")
    tools["ort-basic"] = run_ort_basic
    with tempfile.TemporaryDirectory() as d:
        models = {"foldable": foldable(), **torch_models(Path(d))}
        if args.tf:
            models.update(tf_models(Path(d)))
        print(f"{'model':<18}{'tool':<12}{'nodes':>12}{'ratio':>8}{'ms':>10}{'max |diff|':>12}")
        for name, model in models.items():
            before = len(model.graph.node)
            for tool, fn in tools.items():
                try:
                    out, seconds = measure(fn, model)
                except Exception as exc:
                    print(f"{name:<18}{tool:<12}  failed: {type(exc).__name__}: {exc}"[:160])
                    continue
                after = len(out.graph.node)
                diff = max_diff(model, out)
                print(
                    f"{name:<18}{tool:<12}{f'{before}->{after}':>12}{after / before:>8.2f}"
                    f"{seconds * 1e3:>10.1f}{diff:>12.2e}"
                )


if __name__ == "__main__":
    main()
