"""enginekit's TVM converters for ops that write blocks into a tensor, which TVM 0.27's Relax
importer has no converter for: ``Col2Im`` (sliding blocks summed back into an image) and
``TensorScatter`` (a KV-cache update, opset 24).

``Col2Im`` with static dims is linear with constant coefficients: the sum of every column
element into its image position is one constant 0/1 matrix, built here in numpy, and a
matmul. ``TensorScatter`` is Relax's ``scatter_elements`` with the positions computed from
``write_indices`` (modulo the cache length in ``circular`` mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from enginekit.errors import BuildError

#: The largest Col2Im matrix (columns x image positions) compiled in as a constant.
COL2IM_LIMIT = 1 << 24


def col2im_matrix(
    image: Sequence[int],
    block: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    strides: Sequence[int],
) -> np.ndarray | None:
    """The ``(prod(block) * blocks, prod(image))`` 0/1 matrix taking Col2Im's columns (one
    per block offset and block position, in ONNX's order) to image positions, or None where
    the values do not describe any block (a block larger than the padded image)."""
    r = len(image)
    counts = []
    for i in range(r):
        span = dilations[i] * (block[i] - 1) + 1
        n = (image[i] + pads[i] + pads[r + i] - span) // strides[i] + 1
        if n <= 0:
            return None
        counts.append(n)
    offsets = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1)
    starts = np.stack(np.meshgrid(*[np.arange(n) for n in counts], indexing="ij"), -1)
    offsets = offsets.reshape(-1, r)  # (K, r)
    starts = starts.reshape(-1, r)  # (L, r)
    # position[k, l, i] = start[l, i] * stride - pad_begin + offset[k, i] * dilation
    pos = (
        starts[None, :, :] * np.array(strides) - np.array(pads[:r])
        + offsets[:, None, :] * np.array(dilations)
    )  # fmt: skip
    inside = np.all((pos >= 0) & (pos < np.array(image)), axis=-1)  # (K, L)
    flat = np.ravel_multi_index(
        tuple(np.clip(pos, 0, np.array(image) - 1).transpose(2, 0, 1)), image
    )
    k, at = np.nonzero(inside)
    matrix = np.zeros((offsets.shape[0] * starts.shape[0], int(np.prod(image))), np.float32)
    matrix[k * starts.shape[0] + at, flat[k, at]] = 1.0
    return matrix


def converters() -> dict[str, Any]:
    """The ``Col2Im`` and ``TensorScatter`` converters."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    def constant(inputs: Any, i: int, params: Any) -> np.ndarray | None:
        value = onnx_frontend.get_constant(inputs[i], params)
        if not isinstance(value, tvm.ir.GenericConst):
            return None
        return np.asarray(value.value.numpy())

    class Col2Im(onnx_frontend.OnnxOpConverter):
        """Col2Im as a matmul with :func:`col2im_matrix` (constant ``image_shape`` and
        ``block_shape``, static input dims)."""

        @classmethod
        def _impl_v18(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            name = attr["tvm_custom"]["name"] or "<unnamed>"
            x = inputs[0]
            image, block = constant(inputs, 1, params), constant(inputs, 2, params)
            shape = x.ty.shape
            dims = (
                [int(d) for d in shape]
                if shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in shape)
                else None
            )
            if image is None or block is None or dims is None or len(dims) != 3:
                raise BuildError(
                    f"TVM cannot convert op 'Col2Im' at node {name!r}: enginekit's converter "
                    "needs constant image_shape and block_shape and a static (N, C*K, L) input. "
                    "Build with another backend (e.g. --backend onnxruntime)."
                )
            r = image.size
            image_l, block_l = [int(v) for v in image], [int(v) for v in block]
            dilations = list(attr.get("dilations", [1] * r))
            pads = list(attr.get("pads", [0] * (2 * r)))
            strides = list(attr.get("strides", [1] * r))
            size = int(np.prod(block_l)) * dims[2] * int(np.prod(image_l))
            matrix = None
            if min(image_l + block_l) > 0 and size <= COL2IM_LIMIT:
                matrix = col2im_matrix(image_l, block_l, dilations, pads, strides)
            k = int(np.prod(block_l))
            if matrix is None or dims[1] % k or matrix.shape[0] != k * dims[2]:
                raise BuildError(
                    f"TVM cannot convert op 'Col2Im' at node {name!r}: image_shape {image_l} "
                    f"and block_shape {block_l} do not fit the input's {dims} (or the "
                    f"matrix exceeds {COL2IM_LIMIT} entries). Check the values, or build with "
                    "another backend (e.g. --backend onnxruntime)."
                )
            n, c = dims[0], dims[1] // k
            dtype = str(x.ty.dtype)
            cols = bb.emit(relax.op.reshape(x, (n, c, k * dims[2])))
            out = bb.emit(relax.op.matmul(cols, relax.const(matrix.astype(dtype), dtype)))
            return bb.emit(relax.op.reshape(out, (n, c, *image_l)))

    class TensorScatter(onnx_frontend.OnnxOpConverter):
        """``update`` written into ``past_cache`` along ``axis`` from ``write_indices[b]``
        on (wrapping round in ``circular`` mode), with Relax's scatter_elements."""

        @classmethod
        def _impl_v24(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            cache, update = inputs[0], inputs[1]
            rank = cache.ty.ndim
            axis = int(attr.get("axis", -2)) % rank
            mode = attr.get("mode", b"linear")
            circular = (mode.decode() if isinstance(mode, bytes) else str(mode)) == "circular"
            batch = update.ty.shape[0]
            seq = update.ty.shape[axis]
            view = [1] * rank
            view[axis] = seq
            steps = relax.op.reshape(relax.op.arange(0, seq, 1, "int64"), view)
            if len(inputs) > 2 and inputs[2] is not None:
                starts = bb.emit(relax.op.astype(inputs[2], "int64"))
                first = [batch] + [1] * (rank - 1)
                where = relax.op.add(relax.op.reshape(starts, first), steps)
            else:
                where = steps
            if circular:
                length = relax.const(int(cache.ty.shape[axis]), "int64")
                where = relax.op.floor_mod(where, length)
            where = bb.emit(relax.op.broadcast_to(where, update.ty.shape))
            return bb.emit(relax.op.scatter_elements(cache, where, update, axis))

    return {"Col2Im": Col2Im, "TensorScatter": TensorScatter}
