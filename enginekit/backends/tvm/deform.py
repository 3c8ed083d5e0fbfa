"""enginekit's TVM converter for 2-D ``DeformConv`` (TVM 0.27's Relax importer has none).

Each kernel tap samples the input at its offset position bilinearly (zero outside the image,
as ONNX's reference samples with GridSample): the four corners' flat indices are gathered
from the input per offset group and weighted by the bilinear factors and ``mask``, which
gives the deformed columns ``(N, C, kH*kW, oH*oW)``; a grouped matmul with the weights and
the bias finish the convolution. Static dims only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from enginekit.errors import BuildError


def converters() -> dict[str, Any]:
    """The ``DeformConv`` converter."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend

    def static(x: Any) -> list[int] | None:
        shape = x.ty.shape
        if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
            return None
        return [int(d) for d in shape]

    class DeformConv(onnx_frontend.OnnxOpConverter):
        """Bilinear gathers at the offset positions, then a grouped matmul (module docstring)."""

        @classmethod
        def _impl_v19(cls, bb: Any, inputs: Any, attr: Any, params: Any) -> Any:
            name = attr["tvm_custom"]["name"] or "<unnamed>"
            x, w, offset = inputs[0], inputs[1], inputs[2]
            bias = inputs[3] if len(inputs) > 3 else None
            mask = inputs[4] if len(inputs) > 4 else None
            xs, ws, os_ = static(x), static(w), static(offset)
            if xs is None or ws is None or os_ is None or len(xs) != 4:
                raise BuildError(
                    f"TVM cannot convert op 'DeformConv' at node {name!r}: enginekit's "
                    "converter takes a 2-D convolution with static input, weight and offset "
                    "shapes. Build with another backend (e.g. --backend onnxruntime)."
                )
            n, c, ih, iw = xs
            oc, _, kh, kw = ws
            oh, ow = os_[2], os_[3]
            dtype = str(x.ty.dtype)
            group = int(attr.get("group", 1))
            og = int(attr.get("offset_group", 1))
            sh, sw = (int(v) for v in attr.get("strides", [1, 1]))
            dh, dw = (int(v) for v in attr.get("dilations", [1, 1]))
            pads = [int(v) for v in attr.get("pads", [0, 0, 0, 0])]
            k, p = kh * kw, oh * ow
            # Tap positions without offsets: (kH*kW, oH*oW) rows and columns.
            rows = (np.arange(kh) * dh)[:, None, None, None] + (np.arange(oh) * sh - pads[0])[
                None, None, :, None
            ]
            cols = (np.arange(kw) * dw)[None, :, None, None] + (np.arange(ow) * sw - pads[1])[
                None, None, None, :
            ]
            base_h = np.broadcast_to(rows, (kh, kw, oh, ow)).reshape(1, 1, k, p)
            base_w = np.broadcast_to(cols, (kh, kw, oh, ow)).reshape(1, 1, k, p)
            off = bb.emit(relax.op.reshape(offset, (n, og, k, 2, p)))
            at_h = relax.op.squeeze(relax.op.strided_slice(off, [3], [0], [1]), [3])
            at_w = relax.op.squeeze(relax.op.strided_slice(off, [3], [1], [2]), [3])
            h = bb.emit(relax.op.add(at_h, relax.const(base_h.astype(dtype), dtype)))
            wpos = bb.emit(relax.op.add(at_w, relax.const(base_w.astype(dtype), dtype)))
            h0, w0 = bb.emit(relax.op.floor(h)), bb.emit(relax.op.floor(wpos))
            fh = bb.emit(relax.op.subtract(h, h0))
            fw = bb.emit(relax.op.subtract(wpos, w0))
            one = relax.const(1.0, dtype)
            scale = None
            if mask is not None:
                scale = bb.emit(relax.op.reshape(mask, (n, og, k, p)))
            data = bb.emit(relax.op.reshape(x, (n, og, c // og, ih * iw)))
            sampled: Any = None
            for dy in (0, 1):
                for dx in (0, 1):
                    yy = bb.emit(relax.op.add(h0, relax.const(float(dy), dtype)))
                    xx = bb.emit(relax.op.add(w0, relax.const(float(dx), dtype)))
                    inside = relax.op.logical_and(
                        relax.op.logical_and(
                            relax.op.greater_equal(yy, relax.const(0.0, dtype)),
                            relax.op.less_equal(yy, relax.const(float(ih - 1), dtype)),
                        ),
                        relax.op.logical_and(
                            relax.op.greater_equal(xx, relax.const(0.0, dtype)),
                            relax.op.less_equal(xx, relax.const(float(iw - 1), dtype)),
                        ),
                    )
                    weight = relax.op.multiply(
                        fh if dy else relax.op.subtract(one, fh),
                        fw if dx else relax.op.subtract(one, fw),
                    )
                    weight = relax.op.multiply(weight, relax.op.astype(inside, dtype))
                    if scale is not None:
                        weight = relax.op.multiply(weight, scale)
                    weight = bb.emit(relax.op.reshape(weight, (n, og, 1, k * p)))
                    yi = relax.op.clip(yy, 0.0, float(ih - 1))
                    xi = relax.op.clip(xx, 0.0, float(iw - 1))
                    flat = relax.op.add(
                        relax.op.multiply(relax.op.astype(yi, "int64"), relax.const(iw, "int64")),
                        relax.op.astype(xi, "int64"),
                    )
                    flat = relax.op.reshape(flat, (n, og, 1, k * p))
                    flat = bb.emit(relax.op.broadcast_to(flat, (n, og, c // og, k * p)))
                    picked = relax.op.gather_elements(data, flat, axis=3)
                    term = bb.emit(relax.op.multiply(picked, weight))
                    sampled = term if sampled is None else bb.emit(relax.op.add(sampled, term))
            columns = bb.emit(relax.op.reshape(sampled, (n, group, (c // group) * k, p)))
            kernel = bb.emit(relax.op.reshape(w, (1, group, oc // group, (c // group) * k)))
            out = bb.emit(relax.op.matmul(kernel, columns))
            out = bb.emit(relax.op.reshape(out, (n, oc, oh, ow)))
            if bias is not None:
                out = bb.emit(relax.op.add(out, relax.op.reshape(bias, (1, oc, 1, 1))))
            return out

    return {"DeformConv": DeformConv}
