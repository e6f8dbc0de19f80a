"""Two engine processes on one machine's cores: what a prefill worker's threads cost a decode
worker beside it, and the other way round, with OpenMP threads that spin or sleep while they
wait (why ``pdserve up`` gives a prefill worker every core with ``--share-cores``).

    python bench/core_sharing_probe.py                      # every case below, one at a time
    python bench/core_sharing_probe.py --seconds 8 --cases "prefill:2:passive decode:1"

A case is a set of processes started together, each ``role:threads[:passive]``: a prefill
loop (one 1024-token prompt after another) or a decode loop (16 sequences, one token each per
step). Each loads the model, waits until all are loaded, runs for ``--seconds`` and prints the
median time of its prompts or steps. bf16, prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

DEFAULT_CASES = (
    "prefill:1",
    "prefill:2",
    "prefill:2:passive",
    "decode:1",
    "prefill:1 decode:1",
    "prefill:2 decode:1",
    "prefill:2:passive decode:1",
)


def run_loop(role: str, seconds: float) -> dict:
    """In a child: load an engine, say so, wait for the go line, loop, report."""
    from pdserve.bench.engine_bench import make_engine
    from pdserve.engine.sampling_params import SamplingParams

    engine = make_engine("bfloat16", int(os.environ["PROBE_THREADS"]))
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    if role == "decode":  # its batch prefilled before the clock starts
        for i in range(16):
            engine.add_request(f"d{i}", prompt(150), SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True))
        engine.step()
    print("loaded", flush=True)
    sys.stdin.readline()
    times, deadline = [], time.monotonic() + seconds
    while not times or time.monotonic() < deadline:
        started = time.perf_counter()
        if role == "prefill":
            engine.add_request(
                f"p{len(times)}", prompt(1024), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            )
            while engine.has_unfinished():
                engine.step()
        else:
            engine.step()
        times.append(time.perf_counter() - started)
    return {"n": len(times), "median_ms": round(1e3 * statistics.median(times), 1)}


def run_case(case: str, seconds: float) -> list[dict]:
    children = []
    for spec in case.split():
        role, threads, *policy = spec.split(":")
        env = {**os.environ, "PROBE_THREADS": threads}
        env["OMP_WAIT_POLICY"] = "PASSIVE" if policy == ["passive"] else "ACTIVE"
        cmd = [sys.executable, "-m", "pdserve.bench.core_sharing_probe", "--child", role, "--seconds", str(seconds)]
        child = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children.append((spec, child))
    try:
        for _, child in children:
            if child.stdout.readline().strip() != "loaded":
                raise RuntimeError(f"a child of case {case!r} failed to load")
        for _, child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for spec, child in children:
            out, _ = child.communicate(timeout=seconds + 120)
            if child.returncode != 0:
                raise RuntimeError(f"{spec} of case {case!r} exited with code {child.returncode}")
            results.append({"case": case, "process": spec, **json.loads(out.strip().splitlines()[-1])})
    finally:  # a failed or stuck case leaves no process behind
        for _, child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each case runs (default 8)")
    parser.add_argument("--cases", help="';'-separated cases (default: the table of the docstring)")
    parser.add_argument("--child", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if args.child:
        print(json.dumps(run_loop(args.child, args.seconds)), flush=True)
        return 0
    cases = [c.strip() for c in args.cases.split(";")] if args.cases is not None else list(DEFAULT_CASES)
    bad = [
        spec
        for case in cases
        for spec in case.split()
        if not re.fullmatch(r"(prefill|decode):[1-9]\d*(:passive)?", spec)
    ]
    if bad:
        parser.error(f"--cases: {bad[0]!r} is not role:threads[:passive] (role prefill or decode)")
    if not cases or not all(cases):
        parser.error("--cases: empty case")
    print(f"load average {os.getloadavg()}", flush=True)
    for case in cases:
        for result in run_case(case, args.seconds):
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
