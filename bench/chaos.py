"""Chaos run: bounded load on a local cluster while workers are killed (SIGKILL) at random and
restarted by `pdserve up`. Prints requests sent / completed / failed cleanly / lost / wrong.

    python bench/chaos.py --requests 60 --kills 4 --prefill 2 --decode 2

*lost*: a request that neither finished nor failed with a status within its deadline (a
hang) or whose stream ended without a finish reason. *wrong*: a completed greedy request
whose tokens differ from an undisturbed run of the same prompt. Target: lost = wrong = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

from pdserve.client import build_request
from pdserve.v1 import pdserve_pb2_grpc

PROMPTS = [
    "The capital of France is",
    "Write a short story about a lighthouse keeper.",
    "List three facts about the moon:",
    "In 1969, the first humans",
    "The recipe for a good cup of tea starts with",
]


def children(pid: int) -> dict[int, str]:
    """Live worker processes under the launcher: pid -> role."""
    found = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pdserve.cli" in cmd:
                role = cmd[cmd.index(b"pdserve.cli") + 1].decode()
                found[int(child)] = role
    return found


async def one(stub, prompt: str, max_tokens: int, timeout: float) -> tuple[str, list[int]]:
    ids: list[int] = []
    try:
        finish = ""
        async for msg in stub.Generate(build_request(prompt, max_tokens=max_tokens, temperature=0), timeout=timeout):
            ids += msg.token_ids
            finish = msg.finish_reason or finish
        return ("completed" if finish else "lost"), ids
    except grpc.aio.AioRpcError as e:
        return ("lost" if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED else f"failed:{e.code().name}"), ids


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    port = args.port
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            str(port),
            "--prefill",
            str(args.prefill),
            "--decode",
            str(args.decode),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "256MiB",
            "--policy",
            "round_robin",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in up.stdout:
            if "pdserve ready" in line:
                break
        else:
            raise RuntimeError("pdserve up did not start")
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            reference = {p: (await one(stub, p, args.max_tokens, args.timeout))[1] for p in PROMPTS}

            async def killer() -> int:
                kills = 0
                for _ in range(args.kills):
                    await asyncio.sleep(rng.uniform(1.0, args.kill_interval_s))
                    workers = {pid: role for pid, role in children(up.pid).items() if role != "router"}
                    if workers:
                        victim = rng.choice(sorted(workers))
                        os.kill(victim, signal.SIGKILL)
                        kills += 1
                        print(f"killed {workers[victim]} worker pid {victim}", file=sys.stderr)
                return kills

            semaphore = asyncio.Semaphore(args.concurrency)

            async def client(i: int) -> tuple[str, bool]:
                async with semaphore:
                    prompt = PROMPTS[i % len(PROMPTS)]
                    outcome, ids = await one(stub, prompt, args.max_tokens, args.timeout)
                    return outcome, outcome == "completed" and ids != reference[prompt]

            started = time.monotonic()
            kill_task = asyncio.create_task(killer())
            results = await asyncio.gather(*(client(i) for i in range(args.requests)))
            kills = await kill_task
        outcomes = Counter(o for o, _ in results)
        return {
            "sent": args.requests,
            "completed": outcomes["completed"],
            "failed_cleanly": sum(v for k, v in outcomes.items() if k.startswith("failed")),
            "failure_codes": {k: v for k, v in outcomes.items() if k.startswith("failed")},
            "lost": outcomes["lost"],
            "wrong": sum(1 for _, wrong in results if wrong),
            "kills": kills,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--kill-interval-s", type=float, default=8.0)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=180.0, help="per-request deadline (past it: lost)")
    parser.add_argument("--port", type=int, default=50091)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.kills < 0 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1, --kills >= 0")
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0 if report["lost"] == 0 and report["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
