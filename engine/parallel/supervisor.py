"""Rank 0 starts the other ranks of its worker, one process each, and watches them.

The followers are started from the supervisor's own thread and bound to it with
PR_SET_PDEATHSIG, so they end with the worker however it ends. A follower that dies while the
worker serves takes the worker down at once (``on_death``, by default: exit), whichever sees it
first: this thread's poll, or rank 0's step failing in a collective with the dead rank. The
router sees the worker go, migrates its requests, and ``pdserve up`` (or whatever runs the
worker) starts it again. Waiting on a collective that can never complete is never an option,
nor is failing the requests: they can finish elsewhere.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)
POLL_S = 0.2
STOP_GRACE_S = 10.0
RANK_DIED_EXIT_CODE = 75  # the worker's exit status when one of its ranks died


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the supervisor thread's end ends the rank


def stop_worker(reason: str) -> None:
    """Ends the worker process at once: its gRPC streams break, the router moves its requests."""
    log.error("%s: the worker stops (its requests move elsewhere)", reason)
    logging.shutdown()
    os._exit(RANK_DIED_EXIT_CODE)


def exit_worker(rank: int, code: int) -> None:
    stop_worker(f"rank {rank} of this worker exited with code {code}")


class RankSupervisor:
    def __init__(
        self,
        world_size: int,
        env: dict[str, str],
        rank_cores: list[list[int]] | None,
        on_death: Callable[[int, int], None] = exit_worker,
    ) -> None:
        self.world_size = world_size
        self.env = env  # MASTER_ADDR, MASTER_PORT and the rest every rank shares
        self.rank_cores = rank_cores
        self.on_death = on_death
        self.command = [sys.executable, "-m", "pdserve.engine.parallel.rank_main"]  # what each follower runs
        self.processes: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None  # a rank that died before the worker was up
        self.serving = False  # from now on a death calls on_death
        self._closing = threading.Event()
        self._report_lock = threading.Lock()
        self._reported = False
        self._spawned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._spawned.wait()
        if self.failure:
            raise RuntimeError(self.failure)

    def _run(self) -> None:
        try:
            for rank in range(1, self.world_size):
                self.processes[rank] = self._spawn(rank)
        except OSError as e:
            self.failure = f"could not start the worker's ranks: {e}"
        finally:
            self._spawned.set()
        while not self._closing.wait(POLL_S):
            for rank, process in self.processes.items():
                code = process.poll()
                if code is None:
                    continue
                if self.serving:
                    self.report_death(rank, code)
                    return
                self.failure = self.failure or f"rank {rank} exited with code {code} while the worker was starting"
        # Closing: the ranks got STOP; give them a moment, then make sure.
        for rank, process in self.processes.items():
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not stop; killing it", rank)
                process.kill()
                process.wait()

    def _spawn(self, rank: int) -> subprocess.Popen:
        env = {**os.environ, **self.env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size)}
        if self.rank_cores:
            env["PDSERVE_RANK_CORES"] = ",".join(map(str, self.rank_cores[rank]))
        # Followers never write the worker's stdout (where its ready line goes).
        return subprocess.Popen(self.command, env=env, stdout=sys.stderr.fileno(), preexec_fn=_die_with_parent)

    def report_death(self, rank: int, code: int) -> None:
        """Calls ``on_death`` once, whoever sees the death first (this thread or a failed step)."""
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        self.on_death(rank, code)

    def wait_for_death(self, timeout: float) -> tuple[int, int] | None:
        """(rank, exit code) of a follower that has ended, waiting up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        while True:
            for rank, process in self.processes.items():
                if (code := process.poll()) is not None:
                    return rank, code
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    def close(self) -> None:
        self.serving = False
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(STOP_GRACE_S + 5)
