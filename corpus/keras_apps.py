"""Keras applications (``weights=None``) through enginekit's TensorFlow exporter, small inputs.

Keras models take NHWC images; the reference is the Keras model called on the same arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from corpus.harness import BATCHES, Entry, Made, Sample

TF = ("tensorflow-cpu", "tf2onnx", "keras")


def _keras_entry(name: str, app: str, size: int) -> Entry:
    def make(folder: Path) -> Made:
        import keras

        import enginekit as ek

        keras.utils.set_random_seed(0)
        build: Callable[..., Any] = getattr(keras.applications, app)
        # The backbone's pooled features: at random weights the 10-class softmax head is flat
        # (all 0.1), which would compare equal whatever the engine computed.
        model = build(weights=None, input_shape=(size, size, 3), include_top=False, pooling="avg")
        path = folder / "model.onnx"

        def inputs(batch: int) -> np.ndarray:
            return (
                np.random.default_rng(batch)
                .standard_normal((batch, size, size, 3))
                .astype(np.float32)
            )

        # The harness compares with Keras itself, at a tolerance relative to the output's scale.
        ek.export(model, inputs(2), path, dynamic_batch=True, check=False)
        import onnx

        name_in = onnx.load(str(path), load_external_data=False).graph.input[0].name
        samples = tuple(
            Sample(f"b{b}", {name_in: inputs(b)}, (np.asarray(model(inputs(b), training=False)),))
            for b in BATCHES
        )
        shape = (size, size, 3)
        shapes = {name_in: [(1, *shape), (BATCHES[1], *shape), (BATCHES[-1], *shape)]}
        return Made(path, shapes, samples)

    about = f"keras.applications.{app}, {size}x{size}, pooled features"
    return Entry(name, "keras", make, TF, about)


ENTRIES: tuple[Entry, ...] = (
    _keras_entry("keras-mobilenet_v2", "MobileNetV2", 96),
    _keras_entry("keras-resnet50", "ResNet50", 64),
    _keras_entry("keras-efficientnet_b0", "EfficientNetB0", 64),
)
