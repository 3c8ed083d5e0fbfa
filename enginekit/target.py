"""What the host offers (CPU ISA, machine) and whether an artifact's target can run on it."""

from __future__ import annotations

import functools
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The ISA flags that decide whether compiled CPU code runs (others are noise for us).
ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd",
    "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve", "sve2", "i8mm", "bf16",
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """ISA flags of this host's CPU, as /proc/cpuinfo names them (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split()) & frozenset(ISA_FLAGS)
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name, or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask, SMT siblings
    counted once (from sysfs' core topology; every allowed CPU where that is unreadable)."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id", encoding="utf-8") as f:
                package = f.read().strip()
            with open(topology + "core_id", encoding="utf-8") as f:
                cores.add((package, f.read().strip()))
        except OSError:
            return len(cpus) or 1
    return len(cores) or 1


def cache_bytes() -> int | None:
    """The size of this host's last-level cache (Linux sysfs, cpu0's highest level), or None."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        try:
            value = int(size.rstrip("KMGkmg")) * scale
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, value)
    return best[1] if best else None


def host() -> dict[str, Any]:
    """This host as recorded in manifests and reports."""
    return {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "isa": sorted(cpu_flags()),
        "python": platform.python_version(),
        "system": platform.system(),
    }


def missing_features(target: Mapping[str, Any]) -> list[str]:
    """What the host lacks of an artifact's target: machine mismatch or ISA flags."""
    problems = []
    machine = target.get("machine")
    if machine and machine != platform.machine():
        problems.append(f"machine {machine} (this host is {platform.machine()})")
    if target.get("kind", "cpu") == "cpu":
        lacking = sorted(set(target.get("requires", ())) - cpu_flags())
        if lacking:
            problems.append("CPU features " + ", ".join(lacking))
    return problems
