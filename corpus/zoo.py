"""Classic fixed-batch ONNX files of old opsets, as model zoos ship them.

Made here the way the zoo's were: torchvision models (random weights) exported by the
TorchScript exporter (``dynamo=False``) at opsets 9 to 12 with batch 1 baked in, some with
their initializers listed as graph inputs (as exporters of that era did). The reference is ONNX
Runtime on the original file, run one row at a time; the harness makes each batch-dynamic with
``make_batch_dynamic`` on every run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from corpus import _compat
from corpus._torch import SEED, image_inputs, image_shapes
from corpus.harness import BATCHES, Entry, Made, Sample
from corpus.vision import _vit  # the same small ViT, exported the zoo way

INPUT = "data"


def ort_rows(path: Path, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """ONNX Runtime on a batch-1 file, one row at a time, the rows' outputs joined."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    rows = next(iter(feeds.values())).shape[0]
    outs = [session.run(None, {n: a[i : i + 1] for n, a in feeds.items()}) for i in range(rows)]
    return tuple(np.concatenate([o[k] for o in outs]) for k in range(len(outs[0])))


def _zoo(
    name: str,
    build: Callable[[], Any],
    opset: int,
    size: int = 64,
    as_inputs: bool = False,
    simplified: bool = False,
) -> Entry:
    def make(folder: Path) -> Made:
        import torch

        torch.manual_seed(SEED)
        model = build().eval()
        path = folder / "model.onnx"
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)  # the fused attention op has no ONNX form
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model, (torch.randn(1, 3, size, size),), str(path), dynamo=False,
                opset_version=opset, input_names=[INPUT], output_names=["prob"],
                keep_initializers_as_inputs=as_inputs,
            )  # fmt: skip
        torch.backends.mha.set_fastpath_enabled(fastpath)
        if simplified:
            # As zoo files were run through onnx-simplifier: shape arithmetic folded at batch 1
            # into constants (Reshape [1, ...], Expand of the class token to [1, 1, D]).
            from enginekit.passes import simplify

            onnx.save_model(simplify(str(path)), str(path))
        inputs = image_inputs(size, INPUT)
        samples = []
        for b in BATCHES:
            feeds = inputs(b, b == BATCHES[-1])
            samples.append(Sample(f"b{b}", feeds, ort_rows(path, feeds)))
        return Made(path, image_shapes(size, INPUT), tuple(samples))

    about = f"opset {opset}, batch 1 fixed, {size}x{size}"
    about += ", initializers as inputs" if as_inputs else ""
    about += ", shapes folded to constants" if simplified else ""
    return Entry(f"zoo-{name}-op{opset}", "zoo", make, ("torchvision",), about, fixed_batch=True)


def _tv(name: str, **kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        return getattr(_compat.torchvision().models, name)(weights=None, **kwargs)

    return build


ENTRIES: tuple[Entry, ...] = (
    _zoo("resnet50", _tv("resnet50"), 9, as_inputs=True),
    _zoo("squeezenet1_0", _tv("squeezenet1_0"), 9, as_inputs=True),
    _zoo("shufflenet_v2", _tv("shufflenet_v2_x1_0"), 10),
    _zoo("mobilenet_v2", _tv("mobilenet_v2"), 11),
    _zoo("densenet121", _tv("densenet121"), 12),
    _zoo("googlenet", _tv("googlenet", aux_logits=False, init_weights=True), 11),
    _zoo("inception_v3", _tv("inception_v3", aux_logits=False, init_weights=True), 12, size=96),
    _zoo("mnasnet1_0", _tv("mnasnet1_0"), 10),
    _zoo("vit", _vit, 14),
    _zoo("shufflenet_v2-folded", _tv("shufflenet_v2_x0_5"), 9, simplified=True),
)
