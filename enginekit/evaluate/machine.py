"""The machine a measurement ran on: host facts, package versions, peak resident memory."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from enginekit import target
from enginekit.version import __version__

#: Packages whose versions a report records when installed.
_PACKAGES = (
    "numpy", "onnx", "onnxruntime", "onnxruntime-gpu", "apache-tvm", "jax", "jaxlib",
    "tensorflow-cpu", "tensorflow", "torch", "tensorrt",
)  # fmt: skip


# -- memory --------------------------------------------------------------------------------------


def peak_rss_mb() -> float | None:
    """Peak resident set size of this process (Linux VmHWM), in MiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):
        return None


def reset_peak_rss() -> bool:
    """Reset the peak RSS counter (Linux >= 4.0), so the next reading is this stretch's peak."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def versions() -> dict[str, str]:
    """enginekit, Python and the installed versions of the packages engines run on."""
    out = {"enginekit": __version__, "python": target.host()["python"]}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def host_info() -> dict[str, Any]:
    """The host as a benchmark report records it, with CPU count and load at the start."""
    info = dict(target.host())
    info["cpus"] = os.cpu_count()
    try:
        info["affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        info["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    threads = {k: v for k, v in os.environ.items() if k.endswith("_NUM_THREADS")}
    if threads:
        info["threads_env"] = threads
    return info
