"""A deliberately broken backend for tests: ONNX Runtime on the model with one weight changed.

It is a real backend (it builds and runs), whose engine disagrees with the reference, so the
verification gate has something true to catch.
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from enginekit.backends import onnxruntime as ort_backend
from enginekit.model import load_model

NAME = "broken"
OPTIONS = ort_backend.OPTIONS
available = ort_backend.available


def build(model, config, workdir):
    proto = type(model.proto)()
    proto.CopyFrom(model.proto)
    init = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    w = numpy_helper.to_array(init).copy()
    w.flat[0] += 1.0
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    return ort_backend.build(load_model(proto), config, workdir)


load = ort_backend.load
