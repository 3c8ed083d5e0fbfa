"""A subtly broken backend for tests: ONNX Runtime on the model with one weight tensor 1% off.

The largest float weight tensor (by element count) is multiplied by 1.01 — the kind of error a
wrong layout, a mis-folded BatchNorm or a stale weight file leaves. Verification at default
settings must catch it; see tests/test_verify_rule.py.
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from enginekit.backends import onnxruntime as ort_backend
from enginekit.model import load_model

NAME = "scaled_weight"
OPTIONS = ort_backend.OPTIONS
available = ort_backend.available
#: The factor one weight tensor is multiplied by.
FACTOR = 1.01


def build(model, config, workdir):
    proto = type(model.proto)()
    proto.CopyFrom(model.proto)
    floats = [t for t in proto.graph.initializer if numpy_helper.to_array(t).dtype.kind == "f"]
    init = max(floats, key=lambda t: np.prod(t.dims))
    w = numpy_helper.to_array(init) * np.float32(FACTOR)
    init.CopyFrom(numpy_helper.from_array(w.astype(np.float32), init.name))
    return ort_backend.build(load_model(proto), config, workdir)


load = ort_backend.load
