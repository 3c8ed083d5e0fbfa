"""The few CUDA driver calls the TensorRT runtime needs, through ctypes on ``libcuda``.

Why not cuda-python, torch or cupy: the driver library ships with every NVIDIA driver, so this
needs no extra package and no CUDA toolkit, and its C ABI has been stable for a decade; the
``cuda-bindings`` package must match the CUDA major version the driver supports, and torch or
cupy would be a multi-GB dependency for a dozen calls. Torch and cupy CUDA tensors are still
accepted in and returned out, without a host round trip, through ``__cuda_array_interface__``.

TensorRT uses the CUDA runtime, which runs on each device's *primary* context; this module
retains that same context and makes it current, so both see the same memory and streams.

Nothing here runs on a machine without an NVIDIA driver: :func:`device_count` returns 0 there,
and everything else raises :class:`CudaError`. Only :func:`parse_cuda_array` is pure Python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from enginekit.errors import EnginekitError

# Enum values from cuda.h (stable across CUDA 11-13).
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76
_POINTER_MEMORY_TYPE, _POINTER_DEVICE_ORDINAL = 2, 9
_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED = 2, 4
_STREAM_NON_BLOCKING = 1

_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_SIG: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDeviceGetCount": (ctypes.POINTER(ctypes.c_int),),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetName": (ctypes.c_char_p, ctypes.c_int, ctypes.c_int),
    "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_P), ctypes.c_int),
    "cuCtxSetCurrent": (_P,),
    "cuMemAlloc_v2": (ctypes.POINTER(_U64), ctypes.c_size_t),
    "cuMemFree_v2": (_U64,),
    "cuMemAllocHost_v2": (ctypes.POINTER(_P), ctypes.c_size_t),
    "cuMemFreeHost": (_P,),
    "cuMemcpyHtoDAsync_v2": (_U64, _P, ctypes.c_size_t, _P),
    "cuMemcpyDtoHAsync_v2": (_P, _U64, ctypes.c_size_t, _P),
    "cuStreamCreate": (ctypes.POINTER(_P), ctypes.c_uint),
    "cuStreamSynchronize": (_P,),
    "cuStreamDestroy_v2": (_P,),
    "cuPointerGetAttribute": (_P, ctypes.c_int, _U64),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}


class CudaError(EnginekitError):
    """A CUDA driver call failed, or there is no driver."""


class Driver:
    """The loaded ``libcuda`` with typed functions; use :func:`driver`, not this class."""

    def __init__(self) -> None:
        name = "nvcuda.dll" if sys.platform.startswith("win") else "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise CudaError(
                f"the NVIDIA driver library {name} cannot be loaded ({exc}): no NVIDIA driver "
                "on this machine, or the container was started without GPU access "
                "(docker run --gpus all)"
            ) from None
        for fn, argtypes in _SIG.items():
            f = getattr(lib, fn)
            f.argtypes = argtypes
            f.restype = ctypes.c_int
        self.lib = lib
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self.check(lib.cuInit(0), "cuInit")

    def check(self, status: int, what: str) -> None:
        """Raise CudaError naming the call and CUDA's message for a non-zero status."""
        if status == 0:
            return
        text = ctypes.c_char_p()
        self.lib.cuGetErrorString(status, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise CudaError(f"CUDA {what} failed: {message} (CUresult {status})")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value

    def _device(self, index: int) -> int:
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
        return dev.value

    def name(self, index: int) -> str:
        """The GPU's marketing name, e.g. ``NVIDIA H200``."""
        buf = ctypes.create_string_buffer(256)
        self.check(self.lib.cuDeviceGetName(buf, 256, self._device(index)), "cuDeviceGetName")
        return buf.value.decode()

    def compute_capability(self, index: int) -> str:
        """``"major.minor"``, e.g. ``"9.0"``."""
        dev = self._device(index)
        values = []
        for attr in (_ATTR_CC_MAJOR, _ATTR_CC_MINOR):
            v = ctypes.c_int()
            self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev), "attribute")
            values.append(v.value)
        return f"{values[0]}.{values[1]}"

    def activate(self, index: int) -> None:
        """Make device ``index``'s primary context current on this thread (the runtime's)."""
        with self._lock:
            ctx = self._contexts.get(index)
            if ctx is None:
                handle = _P()
                self.check(
                    self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), self._device(index)),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = self._contexts[index] = int(handle.value or 0)
        self.check(self.lib.cuCtxSetCurrent(_P(ctx)), "cuCtxSetCurrent")

    def alloc(self, nbytes: int) -> int:
        ptr = _U64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), max(nbytes, 1)), "cuMemAlloc")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self.check(self.lib.cuMemFree_v2(ptr), "cuMemFree")

    def alloc_host(self, nbytes: int) -> int:
        ptr = _P()
        self.check(self.lib.cuMemAllocHost_v2(ctypes.byref(ptr), max(nbytes, 1)), "cuMemAllocHost")
        return int(ptr.value or 0)

    def free_host(self, ptr: int) -> None:
        self.check(self.lib.cuMemFreeHost(_P(ptr)), "cuMemFreeHost")

    def to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyHtoDAsync_v2(dst, _P(src), nbytes, _P(stream)), "HtoD copy")

    def to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyDtoHAsync_v2(_P(dst), src, nbytes, _P(stream)), "DtoH copy")

    def stream(self) -> int:
        handle = _P()
        self.check(
            self.lib.cuStreamCreate(ctypes.byref(handle), _STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        return int(handle.value or 0)

    def sync(self, stream: int) -> None:
        self.check(self.lib.cuStreamSynchronize(_P(stream)), "cuStreamSynchronize")

    def destroy_stream(self, stream: int) -> None:
        self.check(self.lib.cuStreamDestroy_v2(_P(stream)), "cuStreamDestroy")

    def pointer_device(self, ptr: int) -> int | None:
        """The device ordinal of device (or managed) memory at ``ptr``; None for host memory."""
        kind = ctypes.c_uint(0)
        status = self.lib.cuPointerGetAttribute(ctypes.byref(kind), _POINTER_MEMORY_TYPE, ptr)
        if status != 0 or kind.value not in (_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED):
            return None
        ordinal = ctypes.c_int(-1)
        self.lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, ptr)
        return ordinal.value


_driver: Driver | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process-wide driver wrapper (loaded on first use).

    Raises:
        CudaError: no NVIDIA driver here.
    """
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver


def device_count() -> int:
    """Number of CUDA devices visible here; 0 without a driver or GPU (never raises)."""
    try:
        return driver().device_count()
    except CudaError:
        return 0


# -- memory ---------------------------------------------------------------------------------------


class DeviceBuffer:
    """``nbytes`` of device memory, freed by :meth:`free` or when garbage collected."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = driver().alloc(self.nbytes)
        self._free = weakref.finalize(self, _safe, driver().free, self.ptr)

    def free(self) -> None:
        self._free()


class PinnedBuffer:
    """``nbytes`` of page-locked host memory (fast, asynchronous copies), seen through numpy."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = driver().alloc_host(self.nbytes)
        self._free = weakref.finalize(self, _safe, driver().free_host, self.ptr)

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A numpy view of the buffer's first ``prod(shape)`` items of ``dtype``."""
        return host_view(self.ptr, self.nbytes, shape, dtype)

    def free(self) -> None:
        self._free()


def host_view(ptr: int, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable numpy array over ``nbytes`` of host memory at address ``ptr`` (no copy)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize > nbytes:
        raise ValueError(
            f"{dtype}{list(shape)} needs {count * dtype.itemsize} bytes, have {nbytes}"
        )
    raw = (ctypes.c_byte * max(nbytes, 1)).from_address(ptr)
    return np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


def _safe(fn: Any, ptr: int) -> None:
    try:
        fn(ptr)
    except CudaError:
        pass  # at interpreter exit the context may already be gone; nothing to recover


class DeviceArray:
    """A CUDA tensor owned by enginekit: hand it to torch or cupy without a copy.

    ``torch.as_tensor(a, device="cuda")`` and ``cupy.asarray(a)`` read it through
    ``__cuda_array_interface__`` (the memory stays alive while they hold it); ``numpy()``
    copies it to the host.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._buffer = DeviceBuffer(self.nbytes)
        self.ptr = self._buffer.ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # enginekit synchronizes before handing the array out
        }

    def numpy(self) -> np.ndarray:
        """A host copy."""
        out = np.empty(self.shape, self.dtype)
        d = driver()
        d.activate(self.device)
        stream = d.stream()
        try:
            d.to_host(out.ctypes.data, self.ptr, self.nbytes, stream)
            d.sync(stream)
        finally:
            d.destroy_stream(stream)
        return out

    def __repr__(self) -> str:
        return f"<DeviceArray cuda:{self.device} {self.dtype}{list(self.shape)}>"


# -- arrays handed in by torch, cupy, numba ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudaView:
    """A C-contiguous CUDA array seen through ``__cuda_array_interface__``."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    stream: int | None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def is_cuda_array(obj: Any) -> bool:
    """Whether ``obj`` exposes ``__cuda_array_interface__`` (torch CUDA tensors, cupy, numba)."""
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:  # torch raises on CPU tensors when the attribute is read
        return False


def parse_cuda_array(obj: Any, name: str) -> CudaView:
    """Read ``obj.__cuda_array_interface__`` (v2/v3) into a CudaView.

    Raises:
        EnginekitError: not a CUDA array, or not C-contiguous (call ``.contiguous()`` first).
    """
    try:
        cai: Mapping[str, Any] = obj.__cuda_array_interface__
    except AttributeError:
        raise EnginekitError(f"{name}: not a CUDA array (no __cuda_array_interface__)") from None
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    ptr = int(cai["data"][0] or 0)
    strides = cai.get("strides")
    if strides is not None:
        expected = []
        step = dtype.itemsize
        for d in reversed(shape):
            expected.append(step)
            step *= d
        if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
            raise EnginekitError(
                f"{name}: the CUDA array is not C-contiguous (strides {tuple(strides)}); pass "
                "x.contiguous() (torch) or cupy.ascontiguousarray(x)"
            )
    if cai.get("mask") is not None:
        raise EnginekitError(f"{name}: masked CUDA arrays are not supported")
    stream = cai.get("stream")
    return CudaView(ptr, shape, dtype, None if stream is None else int(stream))
