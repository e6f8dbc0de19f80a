"""Starting and stopping real pdserve processes for end-to-end tests."""

from __future__ import annotations

import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.process import parse_ready

START_TIMEOUT_S = 240.0


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Proc:
    """A pdserve process whose stdout is watched for its ready line (and, for `up`, 'pdserve ready')."""

    args: list[str]
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset that variable
    prefix: list[str] = field(default_factory=list)  # a command that runs it (unshare ...)
    process: subprocess.Popen = field(init=False)
    lines: queue.Queue = field(default_factory=queue.Queue, init=False)
    output: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        # Some tests read log lines: INFO whatever the outer environment says.
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PDSERVE_LOG_LEVEL": "INFO",
            **self.env,
        }
        env = {name: value for name, value in env.items() if value is not None}
        self.process = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "pdserve.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, predicate, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"pdserve {self.args[0]} exited ({self.process.returncode}):\n{self.log_tail()}"
                    ) from None
                continue
            if predicate(line):
                return line
        raise TimeoutError(f"pdserve {self.args[0]} not ready in {timeout} s:\n{self.log_tail()}")

    def saw(self, predicate, timeout: float = 30.0) -> bool:
        """Whether some output line matches, waiting up to ``timeout`` for it (stderr of children
        and the launcher's own stdout reach us in no fixed order)."""
        deadline = time.monotonic() + timeout
        while not any(predicate(line) for line in list(self.output)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def wait_ready(self) -> dict:
        return parse_ready(self.wait_for(lambda line: parse_ready(line) is not None))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def log_tail(self, n: int = 40) -> str:
        return "".join(self.output[-n:])


@dataclass
class Stack:
    """``pdserve up`` in a subprocess."""

    proc: Proc
    address: str
    children: set[int]
    processes: list[dict]  # each process's name, pid and addresses

    @classmethod
    def up(cls, *extra: str, env: dict[str, str | None] | None = None, prefix: list[str] | None = None) -> "Stack":
        # Port 0: the router binds a port of its own choosing (a port picked here and passed on
        # could be taken by another process meanwhile), and the cluster line says which.
        proc = Proc(["up", "--port", "0", *extra], env=env or {}, prefix=prefix or [])
        proc.wait_for(lambda line: "pdserve ready" in line)
        described = next(line for line in proc.output if line.startswith("pdserve cluster: "))
        processes = json.loads(described[len("pdserve cluster: ") :])
        router = next(p["grpc"] for p in processes if p["role"] == "router")
        return cls(proc, router, descendants(proc.process.pid), processes)

    def down(self, sig: int = signal.SIGTERM) -> None:
        """Stops the stack and checks that no process it started (or restarted) survives."""
        self.children |= descendants(self.proc.process.pid)
        code = self.proc.stop(sig)
        assert code == 0, f"pdserve up exited with {code}:\n{self.proc.log_tail()}"
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in self.children) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = [pid for pid in self.children if alive(pid)]
        assert not leftovers, f"processes left behind by pdserve up: {leftovers}"


@functools.cache
def can_mount_private_shm() -> bool:
    """Whether this process may give a child its own /dev/shm (root with CAP_SYS_ADMIN and unshare)."""
    try:
        probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
