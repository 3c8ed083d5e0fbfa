"""The TVM engine: compiled libraries loaded from a verified artifact, run by Relax VMs.

A build holds one dynamic module (symbolic batch, serves every shape in the profiles) and
optionally tuned static modules, one per batch size; ``_run`` picks the static module whose
input shapes equal the batch's, the dynamic one otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enginekit.backends.tvm.lower import error_line
from enginekit.config import BuildConfig
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import ArtifactError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact

#: TVM accepts DLPack tensors only when their data is 64-byte aligned.
_ALIGN = 64


def load_library(artifact: Artifact, name: str) -> Any:
    """Load payload ``name`` (a shared library) after its checksum matched the manifest.

    The verified bytes are written to a private temporary directory and loaded from there,
    so no file that changed after the check (a directory artifact edited in place) can reach
    the dynamic loader.

    Raises:
        ArtifactError: checksum mismatch, or the library does not load on this host.
    """
    import tvm

    data = artifact.read(name)  # raises ArtifactError on a checksum mismatch
    tmp = Path(tempfile.mkdtemp(prefix="enginekit-tvm-"))
    try:
        path = tmp / Path(name).name
        path.write_bytes(data)
        os.chmod(path, 0o500)
        try:
            return tvm.runtime.load_module(str(path))
        except Exception as exc:
            raise ArtifactError(
                f"{artifact.path}: payload {name!r} does not load here "
                f"({type(exc).__name__}: {error_line(exc)}); "
                "rebuild the engine on this host"
            ) from None
    finally:
        # dlopen keeps the mapping; the file itself is not needed once loaded.
        shutil.rmtree(tmp, ignore_errors=True)


def _device(device: str) -> Any:
    import tvm

    if device.startswith("cuda"):
        return tvm.cuda(int(device.partition(":")[2] or 0))
    return tvm.cpu(0)


class TvmEngine(Engine):
    """An Engine over Relax VM executables compiled by TVM.

    Attributes:
        device: the device the VMs run on (``cpu`` or ``cuda[:N]``).
        static_shapes: input shapes served by tuned static modules.
    """

    def __init__(
        self,
        manifest: Mapping[str, Any],
        dynamic: Any,
        static: Sequence[tuple[dict[str, tuple[int, ...]], Any]],
        device: str,
    ) -> None:
        config = BuildConfig.from_json(manifest["config"])
        super().__init__(
            [TensorSpec.from_json(i) for i in manifest["inputs"]],
            [TensorSpec.from_json(o) for o in manifest["outputs"]],
            config.profiles,
            manifest,
        )
        self.device = device
        self._dev = _device(device)
        self._cpu = not device.startswith("cuda")
        self._dynamic = dynamic
        self._static = {tuple(tuple(s[n]) for n in self._names): lib for s, lib in static}
        self.static_shapes = [dict(s) for s, _ in static]
        self._local = threading.local()
        self._out_names = [o.name for o in self.outputs]

    def _main(self, lib: Any) -> Any:
        """This thread's VM entry for ``lib`` (a Relax VM keeps per-call state: one per thread)."""
        from tvm import relax

        cache = getattr(self._local, "mains", None)
        if cache is None:
            cache = self._local.mains = {}
        main = cache.get(id(lib))
        if main is None:
            main = cache[id(lib)] = relax.VirtualMachine(lib, self._dev)["main"]
        return main

    def _to_tvm(self, array: np.ndarray) -> Any:
        import tvm

        # DLPack (as this TVM speaks it) cannot export a read-only array (np.frombuffer,
        # onnx.numpy_helper, broadcast views): those are copied.
        if array.size == 0:
            # An empty array may carry any strides (onnx's loader gives 0, 0, 0) and numpy
            # exports them as they are; the VM rejects them ("Mismatched x.strides"). A TVM
            # tensor of that shape has compact ones.
            return tvm.runtime.tensor(np.empty(array.shape, array.dtype), device=self._dev)
        aligned = array.ctypes.data % _ALIGN == 0
        if self._cpu and array.flags.c_contiguous and array.flags.writeable and aligned:
            return tvm.runtime.from_dlpack(array)  # zero copy
        # Not np.ascontiguousarray: it makes a 0-d array 1-d, which the VM rejects for a
        # scalar input (Trilu's k, Pow's exponent).
        return tvm.runtime.tensor(np.require(array, requirements="C"), device=self._dev)

    def _from_tvm(self, value: Any) -> np.ndarray:
        if isinstance(value, (tuple, int)):
            # An output computed from shapes alone (ONNX Shape) comes back as TVM's Shape (a
            # tuple of ints) or a plain int, not a tensor.
            return np.asarray(value, dtype=np.int64)
        if self._cpu:
            return np.from_dlpack(value)  # zero copy; the array keeps the TVM tensor alive
        return value.numpy()

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = tuple(a.shape for a in feeds.values())
        lib = self._static.get(key, self._dynamic)
        result = self._main(lib)(*[self._to_tvm(a) for a in feeds.values()])
        single = hasattr(result, "__dlpack__") or isinstance(result, (tuple, int))
        values = [result] if single else list(result)
        return {n: self._from_tvm(v) for n, v in zip(self._out_names, values)}

    def _close(self) -> None:
        self._dynamic = None
        self._static = {}
        self._local = threading.local()
