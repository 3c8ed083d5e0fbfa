"""enginekit's TVM converter for ``TfIdfVectorizer`` over integer tokens (TVM 0.27's Relax
importer has none; string pools stay refused, TVM has no string type).

With the row length static, every n-gram a row can hold is a set of strided slices of it: for
n-gram length ``n`` and skip distance ``d`` the ``j``-th token of each window is
``x[..., j*d : j*d + L]``. Comparing those slices with the pool's n-grams and summing over the
windows counts each pool entry, as ONNX's reference does (unigrams once, longer n-grams for
every skip distance from 1 to ``max_skip_count + 1``); a constant one-hot matrix places the
counts at ``ngram_indexes``, and ``mode`` weights them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from enginekit.errors import BuildError


def pools(attr: dict[str, Any]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """n-gram length -> (the pool's n-grams of that length (P, n), their output indexes)."""
    pool = np.asarray(attr.get("pool_int64s", []), np.int64)
    starts = [int(s) for s in attr.get("ngram_counts", [])]
    indexes = np.asarray(attr.get("ngram_indexes", []), np.int64)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    first = 0
    for n, start in enumerate(starts, start=1):
        end = starts[n] if n < len(starts) else pool.size
        grams = pool[start:end].reshape(-1, n)
        out[n] = (grams, indexes[first : first + len(grams)])
        first += len(grams)
    return out


def converters() -> dict[str, Any]:
    """The ``TfIdfVectorizer`` converter."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    class TfIdfVectorizer(onnx_frontend.OnnxOpConverter):
        """Counts of the pool's n-grams of integer tokens (see the module docstring)."""

        @classmethod
        def _impl_v9(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            name = attr["tvm_custom"]["name"] or "<unnamed>"
            x = inputs[0]
            shape = x.ty.shape
            static = shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape)
            if not static or x.ty.ndim not in (1, 2) or "pool_strings" in attr:
                raise BuildError(
                    f"TVM cannot convert op 'TfIdfVectorizer' at node {name!r}: enginekit's "
                    "converter takes integer tokens (pool_int64s) of a static 1-D or 2-D shape. "
                    "Build with another backend (e.g. --backend onnxruntime)."
                )
            dims = [int(d) for d in shape]
            width = dims[-1]
            rows = x if x.ty.ndim == 2 else bb.emit(relax.op.reshape(x, (1, width)))
            lowest, highest = int(attr["min_gram_length"]), int(attr["max_gram_length"])
            skips = int(attr["max_skip_count"]) + 1
            indexes = np.asarray(attr.get("ngram_indexes", []), np.int64)
            size = int(indexes.max()) + 1 if indexes.size else 0
            dtype = str(x.ty.dtype)
            total: Any = None
            for n, (grams, where) in pools(attr).items():
                if not lowest <= n <= highest or not len(grams):
                    continue
                place = np.zeros((len(grams), size), np.float32)
                place[np.arange(len(grams)), where] = 1.0
                for d in range(1, (1 if n == 1 else skips) + 1):
                    windows = width - d * (n - 1)
                    if windows <= 0:
                        continue
                    match: Any = None
                    for j in range(n):
                        token = relax.op.strided_slice(
                            rows, axes=[1], begin=[j * d], end=[j * d + windows]
                        )
                        want = relax.const(grams[:, j].astype(dtype).reshape(1, 1, -1), dtype)
                        same = relax.op.equal(relax.op.expand_dims(token, [2]), want)
                        match = same if match is None else relax.op.logical_and(match, same)
                    counts = relax.op.sum(relax.op.astype(match, "float32"), axis=[1])
                    placed = bb.emit(relax.op.matmul(counts, relax.const(place, "float32")))
                    total = placed if total is None else bb.emit(relax.op.add(total, placed))
            if total is None:
                total = relax.const(np.zeros((dims[0] if x.ty.ndim == 2 else 1, size), np.float32))
            mode = attr.get("mode", b"TF")
            mode = mode.decode() if isinstance(mode, bytes) else str(mode)
            weights = np.asarray(attr.get("weights", []), np.float32)
            if mode != "TF":
                if mode == "IDF":
                    total = bb.emit(relax.op.minimum(total, relax.const(1.0, "float32")))
                if weights.size:
                    total = bb.emit(
                        relax.op.multiply(total, relax.const(weights[:size], "float32"))
                    )
            if x.ty.ndim == 1:
                total = bb.emit(relax.op.reshape(total, (size,)))
            return total

    return {"TfIdfVectorizer": TfIdfVectorizer}
