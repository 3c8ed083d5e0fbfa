"""The TVM engine: compiled libraries loaded from a verified artifact, run by Relax VMs.

A build holds one dynamic module (symbolic batch, serves every shape in the profiles) and
optionally tuned static modules, one per batch size; ``_run`` picks the static module whose
input shapes equal the batch's, the dynamic one otherwise. With value inputs
(:mod:`enginekit.backends.tvm.values`) the program is picked (or compiled, once) by the values
of those inputs, read on the host; they are not the program's inputs.
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

from enginekit.backends import values as shared
from enginekit.backends.tvm.lower import error_line
from enginekit.config import BuildConfig
from enginekit.engine import Engine, TensorSpec
from enginekit.errors import ArtifactError, BuildError, EngineInputError

if TYPE_CHECKING:
    from enginekit.artifact import Artifact
    from enginekit.backends.tvm.values import Compiler

#: TVM accepts DLPack tensors only when their data is 64-byte aligned.
_ALIGN = 64
#: Staging tensors kept per thread (one per input name, shape and dtype); past this many the
#: thread's set is dropped and starts again (a caller cycling through many shapes).
_STAGED_MAX = 32
#: Inputs smaller than this are copied into a staging tensor without testing their alignment.
_STAGE_BELOW = 1 << 16


def configure_threads() -> None:
    """Give TVM's thread pool one thread per physical core, unless the user chose a number.

    Without ``TVM_NUM_THREADS`` (or ``OMP_NUM_THREADS``), TVM 0.27 takes half the logical
    CPUs on x86, assuming two hyper-threads per core: on a host without SMT (cloud VMs) that
    is half the cores, one thread on a 2-core host, where ONNX Runtime uses both. TVM reads
    the variable when a thread's pool starts (each calling thread has its own), so it is set
    before the first kernel runs; a value already set is left alone.
    """
    if "TVM_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return
    from enginekit.target import physical_cores

    os.environ["TVM_NUM_THREADS"] = str(physical_cores())


def load_library(artifact: Artifact, name: str) -> Any:
    """Load payload ``name`` (a shared library) after its checksum matched the manifest.

    The verified bytes are written to a private temporary directory and loaded from there,
    so no file that changed after the check (a directory artifact edited in place) can reach
    the dynamic loader.

    Raises:
        ArtifactError: checksum mismatch, or the library does not load on this host.
    """
    import tvm

    configure_threads()

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


class Program:
    """A compiled library and its Relax VMs, one per thread (a VM keeps per-call state); the
    VMs go with the program when the value cache drops it."""

    def __init__(self, lib: Any, label: str = "") -> None:
        self.lib = lib
        self.label = label
        self._local = threading.local()

    def main(self, dev: Any) -> Any:
        """This thread's VM entry."""
        main = getattr(self._local, "main", None)
        if main is None:
            from tvm import relax

            main = self._local.main = relax.VirtualMachine(self.lib, dev)["main"]
        return main


class TvmEngine(Engine):
    """An Engine over Relax VM executables compiled by TVM.

    Attributes:
        device: the device the VMs run on (``cpu`` or ``cuda[:N]``).
        static_shapes: input shapes served by tuned static modules.
        value_inputs: inputs read on the host to pick (or compile) a program for their values.
    """

    def __init__(
        self,
        manifest: Mapping[str, Any],
        dynamic: Any,
        static: Sequence[tuple[dict[str, tuple[int, ...]], Any]],
        device: str,
        compiler: Compiler | None = None,
        build_values: Mapping[str, np.ndarray] | None = None,
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
        self._compiler = compiler
        self.value_inputs: tuple[str, ...] = compiler.names if compiler is not None else ()
        #: The inputs the compiled programs take: all but the value inputs, in order.
        self.program_inputs = [n for n in self._names if n not in self.value_inputs]
        self._programs: shared.ProgramCache[Program] = shared.ProgramCache()
        # Tuned static modules were compiled for the build's values only.
        self._build_key = shared.key(build_values) if build_values else None
        if self.value_inputs and build_values:
            self._programs.put(
                self._build_key or (), Program(dynamic, shared.describe(build_values))
            )

    @property
    def programs(self) -> list[str]:
        """With value inputs: the value sets compiled so far, least recently used first."""
        return [p.label for _, p in self._programs.items()]

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

    def _staged(self, name: str, array: np.ndarray) -> tuple[Any, np.ndarray]:
        """This thread's staging tensor for input ``name`` at ``array``'s shape and dtype, and
        a numpy view of it (made once, reused by every call with that shape)."""
        import tvm

        cache = getattr(self._local, "staged", None)
        if cache is None:
            cache = self._local.staged = {}
        key = (name, array.shape, array.dtype)
        entry = cache.get(key)
        if entry is None:
            if len(cache) >= _STAGED_MAX:
                cache.clear()
            tensor = tvm.runtime.empty(array.shape, str(array.dtype), self._dev)
            entry = cache[key] = (tensor, np.from_dlpack(tensor))
        return entry

    def _input(self, name: str, array: np.ndarray, staged: list[np.ndarray]) -> Any:
        """``array`` as the VM's argument: zero copy when TVM accepts it as it is, else copied
        into a reused staging tensor (recorded in ``staged``) — ~3 us where allocating a TVM
        tensor per call cost ~180 us (measured on a 1x16 input, loaded 2-core host). Small
        arrays are always staged: reading the address to test its alignment (``ctypes``)
        costs more than copying them."""
        if not self._cpu or array.size == 0 or array.dtype.kind not in "biuf":
            return self._to_tvm(array)
        if array.nbytes >= _STAGE_BELOW and array.flags.carray and array.ctypes.data % _ALIGN == 0:
            import tvm

            return tvm.runtime.from_dlpack(array)  # zero copy
        tensor, view = self._staged(name, array)
        np.copyto(view, array, casting="no")
        staged.append(view)
        return tensor

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

    def _specialize(self, held: dict[str, np.ndarray]) -> Program:
        assert self._compiler is not None
        try:
            lib = self._compiler(held, self.device)
        except BuildError as exc:
            raise EngineInputError(
                f"the TVM engine compiles a program for the values of {', '.join(held)}, and "
                f"{shared.describe(held)} does not compile: {exc}. Pass values the model accepts"
            ) from None
        return Program(lib, shared.describe(held))

    def _select(self, feeds: Mapping[str, np.ndarray]) -> tuple[Any, Program | None]:
        """(the library ``feeds`` run on, its Program when picked by values)."""
        shapes = tuple([feeds[n].shape for n in self._names])
        if not self.value_inputs:
            return self._static.get(shapes, self._dynamic), None
        held = {n: np.asarray(feeds[n]) for n in self.value_inputs}
        key = shared.key(held)
        if key == self._build_key and shapes in self._static:
            return self._static[shapes], None
        program = self._programs.get(key, lambda: self._specialize(held))
        return program.lib, program

    def library(self, feeds: Mapping[str, np.ndarray]) -> Any:
        """The compiled library ``infer(feeds)`` runs (compiled now for new values of value
        inputs); it takes :attr:`program_inputs`."""
        return self._select({n: np.asarray(feeds[n]) for n in self._names})[0]

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lib, program = self._select(feeds)
        main = program.main(self._dev) if program is not None else self._main(lib)
        staged: list[np.ndarray] = []
        result = main(*[self._input(n, feeds[n], staged) for n in self.program_inputs])
        single = hasattr(result, "__dlpack__") or isinstance(result, (tuple, int))
        values = [result] if single else list(result)
        out = {n: self._from_tvm(v) for n, v in zip(self._out_names, values)}
        if staged:
            # An output may be a staging tensor itself, or a view of one (an Identity or
            # Reshape of an input): the next call would overwrite it, so it is copied.
            for n, a in out.items():
                if any(np.shares_memory(a, v) for v in staged):
                    out[n] = a.copy()
        return out

    def _close(self) -> None:
        self._dynamic = None
        self._static = {}
        self._local = threading.local()
        self._programs.clear()
