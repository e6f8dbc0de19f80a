"""Counters bumped on several threads while others read them (stats RPCs, metrics scrapes)."""

from __future__ import annotations

import sys
import threading

from pdserve.event_counts import EventCounts


def test_increments_from_many_threads_are_not_lost_and_readers_never_fail():
    counts, errors = EventCounts(), []
    writers_done = threading.Event()

    def bump(worker: int) -> None:
        for i in range(2000):
            counts.add(f"event_{worker}_{i % 50}")  # new keys keep appearing
            counts.add("bytes", 3)

    def read() -> None:
        while not writers_done.is_set():
            try:
                assert sum(v for k, v in counts.snapshot().items() if k != "bytes") >= 0
            except RuntimeError as e:  # "dictionary changed size during iteration"
                errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        reader = threading.Thread(target=read)
        reader.start()
        writers = [threading.Thread(target=bump, args=(w,)) for w in range(4)]
        for t in writers:
            t.start()
        for t in writers:
            t.join(30)
        writers_done.set()
        reader.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    snapshot = counts.snapshot()
    assert snapshot["bytes"] == 4 * 2000 * 3
    assert sum(v for k, v in snapshot.items() if k != "bytes") == 4 * 2000
    assert counts["event_0_0"] == 40 and counts["never"] == 0
