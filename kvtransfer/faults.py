"""Fault injection for the KV sender, for tests and chaos runs: ``PDSERVE_KV_FAULTS``.

``corrupt=N`` flips a byte of the K/V data of the first N units sent, after their checksum
was taken (the receiver must notice); ``stall=N`` makes the first N transfers stop before
DONE (the receiver's lease runs out). Unset, it costs one attribute check per unit.
"""

from __future__ import annotations

import os
import threading

ENV = "PDSERVE_KV_FAULTS"


class FaultPlan:
    def __init__(self, spec: str = "") -> None:
        self._left: dict[str, int] = {}
        self._lock = threading.Lock()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, count = part.partition("=")
            if name not in ("corrupt", "stall") or not count.isdigit():
                raise ValueError(f"{ENV}: expected corrupt=N and/or stall=N, got {part!r}")
            self._left[name] = int(count)
        self.active = bool(self._left)

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls(os.environ.get(ENV, ""))

    def take(self, name: str) -> bool:
        """True (and one fewer left) if a ``name`` fault is due now."""
        if not self.active:
            return False
        with self._lock:
            if self._left.get(name, 0) <= 0:
                return False
            self._left[name] -= 1
            return True
