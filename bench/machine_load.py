"""How busy the machine was around a benchmark: load average, and the CPU other processes took."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def busy_cpu_seconds() -> float | None:
    """CPU time spent by everything on the machine (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields] + [0] * 8
    # user + nice + system + irq + softirq; idle, iowait and steal (the hypervisor's) are not ours to count
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    return int(fields[7]) / os.sysconf("SC_CLK_TCK") if len(fields) > 7 else None


def own_cpu_seconds() -> float:
    """This process's CPU time and its finished children's (the decode sides)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


class LoadProbe:
    """Load average at start and end, and how much CPU other processes used meanwhile."""

    def __init__(self) -> None:
        self.start_load = loadavg()
        self.start_wall = time.monotonic()
        self.start_busy = busy_cpu_seconds()
        self.start_own = own_cpu_seconds()
        self.start_steal = steal_seconds()

    def report(self) -> dict:
        wall = time.monotonic() - self.start_wall
        cores = os.cpu_count() or 1
        busy = busy_cpu_seconds()
        other = steal = None
        if busy is not None and self.start_busy is not None:
            other = max(0.0, (busy - self.start_busy) - (own_cpu_seconds() - self.start_own))
        if self.start_steal is not None:
            steal = steal_seconds() - self.start_steal
        return {
            "cpu_count": cores,
            "loadavg_start": self.start_load,
            "loadavg_end": loadavg(),
            "wall_s": round(wall, 2),
            "other_cpu_s": None if other is None else round(other, 2),
            "other_cpu_share": None if other is None else round(other / (wall * cores), 3),
            "steal_cpu_s": None if steal is None else round(steal, 2),
            # Load from others at start (1-min average) or CPU they used during the run.
            "other_load_present": bool(
                (self.start_load and self.start_load[0] >= 0.5)
                or (other is not None and other / (wall * cores) >= 0.05)
            ),
        }
