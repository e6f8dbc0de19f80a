"""How long the router process takes to start and how much memory it holds once ready.

    python bench/router_startup.py --runs 5

Starts ``pdserve router`` (pointed at a worker address nobody listens on: its probes fail
fast and it serves anyway) and times it from exec to its ready line; at that moment reads
the process's resident memory (VmRSS, and the peak VmHWM) from /proc and checks whether
libtorch is mapped into it. The default model must already be converted (any earlier
``pdserve up`` or test run does that), so conversion is not what gets timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdserve.process import parse_ready


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _maps_torch(pid: int) -> bool:
    return any("libtorch" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def start_once(timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", "0", "--decode-workers", "127.0.0.1:9"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = started + timeout_s
        for line in proc.stdout:
            if parse_ready(line) is not None:
                ready_s = time.perf_counter() - started
                return {
                    "ready_s": ready_s,
                    "rss_mib": _status_kib(proc.pid, "VmRSS") / 1024,
                    "peak_rss_mib": _status_kib(proc.pid, "VmHWM") / 1024,
                    "torch_loaded": _maps_torch(proc.pid),
                }
            if time.perf_counter() > deadline:
                break
        raise RuntimeError(f"the router printed no ready line (exit code {proc.poll()})")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one start")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    runs = [start_once(args.timeout) for _ in range(args.runs)]
    report = {
        "runs": args.runs,
        "ready_s_median": round(statistics.median(r["ready_s"] for r in runs), 3),
        "ready_s_max": round(max(r["ready_s"] for r in runs), 3),
        "rss_mib_median": round(statistics.median(r["rss_mib"] for r in runs), 1),
        "peak_rss_mib_max": round(max(r["peak_rss_mib"] for r in runs), 1),
        "torch_loaded": any(r["torch_loaded"] for r in runs),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
