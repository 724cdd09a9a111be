"""The CPU backend's compute threads: as many as the cores this process may use, and idle ones that sleep.

torch's default is every core of the machine, whatever the process's affinity mask or cgroup quota allows, and its
OpenMP threads spin at each barrier. On a machine shared with other work both go wrong at once: a thread that
shares a core with a busy process holds up every parallel region, and the spinning threads take the core from it.
So the engine runs `usable_cores()` threads unless told otherwise (`--cpu-threads`), and the command line asks
OpenMP for its passive wait policy before torch loads (`prefer_passive_wait`): threads that reach a barrier early
sleep instead of spinning.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cores(cgroup_cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cgroup_cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def prefer_passive_wait() -> bool:
    """Ask OpenMP to put waiting threads to sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the environment chose.

    The runtime reads the variable once, when torch loads it, so this must run before torch is imported; returns
    whether it can still take effect."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules


@dataclass(slots=True, frozen=True)
class CpuThreads:
    """The intra-op thread count an engine set, and the one it replaced (restored at shutdown)."""

    threads: int
    previous: int

    @property
    def wait_policy(self) -> str:
        return os.environ.get("OMP_WAIT_POLICY", "spin (OpenMP default)").lower()

    def describe(self) -> str:
        return f"{self.threads} of {usable_cores()} usable cores, OpenMP wait {self.wait_policy}"

    def restore(self) -> None:
        import torch

        torch.set_num_threads(self.previous)


def set_cpu_threads(threads: int) -> CpuThreads:
    """Set torch's intra-op threads for the calling thread and for threads that have not run torch yet (OpenMP
    keeps a count per thread): call it on every thread that computes."""
    import torch

    if threads < 1:
        raise ValueError(f"cpu_threads must be at least 1, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    return CpuThreads(threads, previous)
