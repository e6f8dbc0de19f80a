"""Event counters that several threads bump and others read (stats RPCs, metrics scrapes)."""

from __future__ import annotations

import threading
from collections import Counter


class EventCounts(Counter):
    """A ``Counter`` whose ``add`` is atomic and whose ``snapshot`` is consistent.

    ``counts[key] += 1`` from two threads can lose an increment, and iterating a plain dict
    while another thread adds its first key raises ``RuntimeError``. Bump with ``add`` and read
    with ``snapshot``; single-key reads (``counts[key]``) stay as they are.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, key: str, amount: float = 1) -> None:
        with self._lock:
            self[key] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self)
