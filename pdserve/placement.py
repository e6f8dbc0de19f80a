"""Where each worker of ``pdserve up`` runs, and how much of its device the KV cache may take.

On a machine with GPUs every worker gets a device of its own while there are enough (round
robin over the visible GPUs, prefill workers first), or the devices listed for its role
(``--prefill-devices cuda:0 --decode-devices cuda:1,cuda:2``; a list shorter than the pool is
reused round robin). Workers that share a GPU share its memory: where one worker alone would
take a fraction of the free memory for its KV cache (``auto``: 90%), each of the k sharing it
takes a k-th of that fraction, measured when it allocates, so together they never take more
than one would alone. An explicit size (``8GiB``) is per worker already and stays as given.
CPU workers are left as they are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.engine_config import parse_memory

AUTO_GPU_FRACTION = 0.9  # what ``kv_cache_memory=auto`` takes of a GPU's free memory (engine/kv_cache.py)
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class Placement:
    device: str  # a torch device for the worker's --device ("auto" and "cpu" pass through)
    kv_cache_memory: str  # its --kv-cache-memory


def parse_devices(text: str, setting: str) -> list[str]:
    """'cuda:0, cuda:1' -> ['cuda:0', 'cuda:1'] ('cuda' means 'cuda:0'); raises ValueError naming ``setting``."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise ValueError(f"{setting}: {device!r} is not a device (cpu, cuda or cuda:N)")
    return [_canonical(d) for d in devices]


def _canonical(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def _share(budget: str, sharing: int) -> str:
    """One worker's budget when ``sharing`` workers share a GPU."""
    if sharing == 1:
        return budget
    if budget == "auto":
        return f"{AUTO_GPU_FRACTION / sharing:.6g}"
    _, fraction = parse_memory(budget)  # however it is spelled: 0.5, .5, 00.5, 0.5e0
    if fraction is not None:
        return f"{fraction / sharing:.6g}"
    return budget  # a size: already per worker


def plan(
    roles: list[str],
    *,
    device: str,
    kv_cache_memory: str,
    num_gpus: int,
    role_devices: dict[str, list[str]] | None = None,
) -> list[Placement]:
    """A placement per worker, in the order of ``roles`` (one role name per worker).

    ``device`` is the engine's setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``); ``num_gpus`` the
    GPUs the workers will see; ``role_devices`` the explicit lists per role, if any.
    """
    role_devices = {role: devices for role, devices in (role_devices or {}).items() if devices}
    seen: Counter[str] = Counter()
    devices = []
    for n, role in enumerate(roles):
        if role in role_devices:
            listed = role_devices[role]
            devices.append(listed[seen[role] % len(listed)])
        elif device in ("auto", "cuda") and num_gpus > 0:
            devices.append(f"cuda:{n % num_gpus}")
        else:
            devices.append(_canonical(device))
        seen[role] += 1
    per_device = Counter(d for d in devices if d.startswith("cuda"))
    return [
        Placement(d, _share(kv_cache_memory, per_device[d]) if d.startswith("cuda") else kv_cache_memory)
        for d in devices
    ]


def usable_cores() -> int:
    """The cores this process may run on (a taskset or cpuset narrows them; all of the machine's
    where affinity is not exposed)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_worker(num_workers: int) -> int:
    """Torch threads for each of ``num_workers`` CPU workers of one machine, unpinned: its cores split evenly."""
    return max(1, usable_cores() // max(1, num_workers))


def borrowed_threads(
    cores: int, *, prefill: int, decode: int, colocated: bool = False, pinned: bool = False, by_hand: bool = False
) -> int | None:
    """The threads a CPU decode worker's decode-only steps take while no prefill computes for
    it (engine/thread_budget.py), as ``pdserve up`` sets them: all ``cores`` for the one decode
    worker beside unpinned prefill workers at thread counts the launcher chose; None otherwise
    (with two decode workers, a prefill for one would not stop the other from borrowing)."""
    if colocated or prefill < 1 or decode != 1 or pinned or by_hand:
        return None
    return cores


def shared_prefill_threads(
    cores: int, *, prefill: int, decode: int, colocated: bool = False, pinned: bool = False, by_hand: bool = False
) -> int | None:
    """The threads of a CPU prefill worker that shares the machine with decode workers, as
    ``pdserve up`` sets them: the prefill pool's split of all ``cores``, with threads that sleep
    while they wait (``share_cores``), so a prefill takes whatever cores the decode workers leave
    idle and gives them back at once when a decode step starts (measured: a two-thread prefill
    beside a busy one-thread decode worker runs at one-thread speed, the decode step at its own).
    None when that split is no more than the even one (two prefill workers on two cores each
    took one anyway, and two teams of two made the decode worker's ITL 16-37% longer), when
    pinned, colocated, without both pools, or with thread counts set by hand."""
    if colocated or prefill < 1 or decode < 1 or pinned or by_hand:
        return None
    shared = max(1, cores // prefill)
    return shared if shared > max(1, cores // (prefill + decode)) else None


def count_visible_gpus() -> int:
    """The GPUs a worker started from here will see. torch answers in a short-lived child
    process, so the launcher neither loads torch nor holds a CUDA context on any GPU; a
    machine without a GPU driver is not asked at all."""
    if not any(Path(p).exists() for p in ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/kfd")):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0
