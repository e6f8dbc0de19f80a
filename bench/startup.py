"""How long pdserve takes to start, and how much memory its processes hold once ready.

    python bench/startup.py router --runs 5     # the router alone
    python bench/startup.py up --runs 3         # a whole `pdserve up` (1P1D by default)
    python bench/startup.py up --runs 3 -- --colocated --dtype bfloat16

``router`` starts ``pdserve router`` pointed at a worker address nobody listens on (its probes
fail fast and it serves anyway) and times it from exec to its ready line; ``up`` times ``pdserve
up`` (extra flags after ``--``) from exec to ``pdserve ready``. At that moment each process's
resident memory (VmRSS, and the peak VmHWM) is read from /proc, and whether libtorch is mapped
into it. The default model must already be converted (any earlier ``pdserve up`` or test run
does that), so conversion is not what gets timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.process import parse_ready

CLUSTER_LINE = "pdserve cluster: "


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _maps_torch(pid: int) -> bool:
    return any("libtorch" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def _memory(pid: int) -> dict:
    return {
        "rss_mib": _status_kib(pid, "VmRSS") / 1024,
        "peak_rss_mib": _status_kib(pid, "VmHWM") / 1024,
        "torch_loaded": _maps_torch(pid),
    }


def start_once(what: str, extra: list[str], timeout_s: float) -> dict:
    """One start: seconds to ready, and the memory of each process by name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    if what == "router":
        args = ["router", "--port", "0", "--decode-workers", "127.0.0.1:9", *extra]
    else:
        args = ["up", "--port", "0", *extra]
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    # A process that hangs without printing would block the read below: killed at the deadline,
    # its stdout ends and the start fails.
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        pids = {}
        for line in proc.stdout:
            if line.startswith(CLUSTER_LINE):
                pids = {p["name"]: p["pid"] for p in json.loads(line[len(CLUSTER_LINE) :])}
            ready = parse_ready(line) is not None if what == "router" else line.startswith("pdserve ready")
            if ready:
                ready_s = time.perf_counter() - started
                return {"ready_s": ready_s, "processes": {n: _memory(p) for n, p in (pids or {what: proc.pid}).items()}}
        raise RuntimeError(f"pdserve {what} did not get ready within {timeout_s:g} s (exit code {proc.poll()})")
    finally:
        watchdog.cancel()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summarize(runs: list[dict]) -> dict:
    names = runs[0]["processes"]
    return {
        "runs": len(runs),
        "ready_s_median": round(statistics.median(r["ready_s"] for r in runs), 3),
        "ready_s_max": round(max(r["ready_s"] for r in runs), 3),
        "processes": {
            name: {
                "rss_mib_median": round(statistics.median(r["processes"][name]["rss_mib"] for r in runs), 1),
                "peak_rss_mib_max": round(max(r["processes"][name]["peak_rss_mib"] for r in runs), 1),
                "torch_loaded": any(r["processes"][name]["torch_loaded"] for r in runs),
            }
            for name in names
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("router", "up"), default="router")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for one start")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # the started command's flags
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    runs = [start_once(args.what, extra, args.timeout) for _ in range(args.runs)]
    print(json.dumps({"command": " ".join(["pdserve", args.what, *extra]), **summarize(runs)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
