"""Value inputs on TVM: programs compiled for the values of inputs that decide shapes.

TVM's Relax importer builds shapes, axes, pads and sizes from constants: a Reshape whose shape,
a Range whose limits or a TopK whose k comes from a graph input fails to import (or imports with
shapes it cannot compile). Such inputs (:func:`find`: the backend-neutral detection of
:mod:`enginekit.backends.values` with its table of shape operands, which holds every input
TVM's importer reads as a constant) are bound as ONNX
initializers before the import, so the usual pipeline compiles a static-shape program for the
build's example values (the first verification point's, so verification runs it). The artifact
keeps ``model.onnx`` too; at inference the engine reads those inputs on the host and compiles a
program for each new set of values once (:class:`Compiler`, into the shared
:class:`~enginekit.backends.values.ProgramCache`: an LRU of
:data:`~enginekit.backends.values.CACHE_SIZE` per engine, compiling outside its lock). See
docs/backends/tvm.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from enginekit.backends import values as shared
from enginekit.backends.tvm.windows import col2im_matrix
from enginekit.errors import BuildError

log = logging.getLogger(__name__)

#: The ONNX model kept in the payload of an engine with value inputs.
MODEL = "model.onnx"


def find(proto: onnx.ModelProto) -> dict[str, str]:
    """Graph inputs whose values TVM must know to import and compile the model.

    Returns:
        input name -> where it first arrives (``"r (Reshape) input 1"``), in graph input order.
    """
    return shared.find(proto, shared.SHAPE_INPUTS)


def accepted(proto: onnx.ModelProto, example: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``example`` with generated Resize ``scales`` that are not all positive replaced by
    ones (an identity resize), likewise Upsample ``scales`` TVM does not take, an AffineGrid ``size`` that is not all positive by a small
    grid, and a OneHot ``depth`` or window size below 1 by 2: the example values are random there, which neither op accepts, so the build's own
    program would not compile (verification then asks for ``verify_data=``). The engine compiles a program
    for the values it is given later, as for any value input."""
    out = dict(example)
    for node in proto.graph.node:
        if node.op_type == "Resize" and len(node.input) > 2 and node.input[2] in out:
            scales = np.asarray(out[node.input[2]])
            if scales.dtype.kind == "f" and scales.size and not (scales > 0).all():
                out[node.input[2]] = np.ones_like(scales)
        if node.op_type == "AffineGrid" and len(node.input) > 1 and node.input[1] in out:
            size = np.asarray(out[node.input[1]])
            if size.ndim == 1 and size.size in (4, 5) and not (size > 0).all():
                # theta's batch where static, then one channel and 2 x 2 (x 2) points.
                out[node.input[1]] = np.array(
                    [_batch(proto, node.input[0]), 1, *[2] * (size.size - 2)], size.dtype
                )
        if node.op_type == "Upsample" and len(node.input) > 1 and node.input[1] in out:
            scales = np.asarray(out[node.input[1]])
            # TVM's Upsample takes scales of at least 1 that keep batch and channels.
            if scales.ndim == 1 and scales.size > 2:
                if not ((scales[:2] == 1).all() and (scales >= 1).all()):
                    out[node.input[1]] = np.ones_like(scales)
        if node.op_type == "OneHot" and len(node.input) > 1 and node.input[1] in out:
            depth = np.asarray(out[node.input[1]])
            # Under 1 (a float depth truncates) the output is empty, and TVM cannot load a
            # library holding an empty constant ("Invalid DLTensor file format").
            if depth.size == 1 and not (depth >= 1).all():
                out[node.input[1]] = np.full_like(depth, 2)  # off and on
        if node.op_type in _WINDOWS and node.input and node.input[0] in out:
            size = np.asarray(out[node.input[0]])
            if size.size == 1 and not (size >= 1).all():
                out[node.input[0]] = np.full_like(size, 2)  # an empty window: as for OneHot
        if node.op_type == "Col2Im" and len(node.input) > 2:
            _col2im_example(proto, node, out)
    return out


#: Window ops, whose input 0 is the window's size.
_WINDOWS = frozenset({"HannWindow", "HammingWindow", "BlackmanWindow"})


def _col2im_example(proto: onnx.ModelProto, node: onnx.NodeProto, out: dict[str, Any]) -> None:
    """A Col2Im ``image_shape`` and ``block_shape`` (value inputs, in ``out``) that fit its
    static ``(N, C*K, L)`` input where the generated ones do not: blocks of one element, all
    L blocks along the first axis."""
    image_name, block_name = node.input[1], node.input[2]
    if image_name not in out or block_name not in out:
        return
    image, block = np.asarray(out[image_name]), np.asarray(out[block_name])
    dims = _dims(proto, node.input[0])
    if image.ndim != 1 or block.shape != image.shape or dims is None or len(dims) != 3:
        return
    r = image.size
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    pads = list(attrs.get("pads", [0] * 2 * r))
    strides = list(attrs.get("strides", [1] * r))
    if (image > 0).all() and (block > 0).all():
        k = int(np.prod(block))
        matrix = col2im_matrix(
            [int(v) for v in image], [int(v) for v in block],
            list(attrs.get("dilations", [1] * r)), pads, strides,
        )  # fmt: skip
        if matrix is not None and matrix.shape[0] == k * dims[2] and dims[1] % k == 0:
            return  # they fit
    # Past the first axis, the smallest image dim whose block count (blocks of one element)
    # divides what is left of the L blocks; the first axis takes the rest.
    left, sizes = dims[2], [0]
    for i in range(1, r):
        for size in range(1, left + 1):
            count = (size + pads[i] + pads[r + i] - 1) // strides[i] + 1
            if count > 0 and left % count == 0:
                left //= count
                sizes.append(size)
                break
        else:
            return  # no fitting blocks of one element: the build's import says what is wrong
    sizes[0] = (left - 1) * strides[0] - pads[0] - pads[r] + 1
    if sizes[0] < 1:
        return
    out[image_name] = np.array(sizes, image.dtype)
    out[block_name] = np.ones(r, block.dtype)


def _dims(proto: onnx.ModelProto, name: str) -> list[int] | None:
    """The static dims of graph input ``name``, else None."""
    for value in proto.graph.input:
        if value.name == name:
            dims = value.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                return [int(d.dim_value) for d in dims]
    return None


def _batch(proto: onnx.ModelProto, name: str) -> int:
    """The static first dim of graph input ``name``, else 1."""
    dims = _dims(proto, name)
    return dims[0] if dims else 1


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to compile a program for new values the way the build compiled its own.

    Attributes:
        layout: ``NHWC`` or ``NCHW``, as the build chose (an NHWC program that fails is
            compiled NCHW, as at build).
        schedule: the build's ``schedule`` option.
        precision: ``fp32`` or ``bf16``.
        target: the build's target in TVM's JSON form (manifest ``backend.metadata.target``).
    """

    layout: str
    schedule: str
    precision: str
    target: Mapping[str, Any]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Recipe:
        return cls(
            layout=str(meta.get("layout", "NCHW")),
            schedule=str(meta.get("schedule", "enginekit")),
            precision=str(meta.get("precision", "fp32")),
            target=dict(meta.get("target") or {}),
        )


def compile_program(mod: Any, target: Any, recipe: Recipe) -> Any:
    """An imported module optimized, scheduled and compiled as the build does, loaded for the
    Relax VM (a runtime module, no file).

    Raises:
        BuildError: TVM failed on it in both layouts.
    """
    from enginekit.backends.tvm import lower

    try:
        _, fused, _ = lower.optimize(mod, target, recipe.layout, recipe.precision)
    except BuildError:
        if recipe.layout != "NHWC":
            raise
        _, fused, _ = lower.optimize(mod, target, "NCHW", recipe.precision)
    return lower.schedule_and_compile(fused, target, recipe.schedule)[0].jit()


class Compiler:
    """Compiles the kept ONNX model for one set of values of the value inputs ``names``.

    Attributes:
        names: the value inputs, in graph input order.
    """

    def __init__(
        self, model_bytes: bytes, dtypes: Mapping[str, str], names: tuple[str, ...], recipe: Recipe
    ) -> None:
        self.names = names
        self.recipe = recipe
        self._bytes = model_bytes
        self._dtypes = {n: d for n, d in dtypes.items() if n not in names}
        self._proto: onnx.ModelProto | None = None

    def proto(self) -> onnx.ModelProto:
        """The ONNX model, parsed on first use."""
        if self._proto is None:
            self._proto = onnx.load_from_string(self._bytes)
        return self._proto

    def __call__(self, values: Mapping[str, np.ndarray], device: str) -> Any:
        """The program for ``values`` (a runtime module for ``relax.VirtualMachine``).

        Raises:
            BuildError: the values do not import or compile (a shape the data cannot take...).
        """
        from enginekit.backends.tvm import frontend, lower

        target = lower.resolve_target(dict(self.recipe.target) or None, device)
        mod = frontend.import_proto(frontend.bound(self.proto(), values), self._dtypes)
        log.info("tvm: compiling a program for %s", shared.describe(values))
        return compile_program(mod, target, self.recipe)
