"""``pdserve simulate --profile FILE``: the serving benchmark's runs, simulated.

Takes ``pdserve bench``'s options (modes, workload, rates, burstiness, seed, SLOs, engine and
stack settings) and writes the same result files (vLLM's key names, one per mode and rate),
tables and plots, from the simulator instead of a started stack. The requests are the
benchmark's own: ``workloads.build`` with the same seed, one ``workloads.variant`` per rate,
sent at ``arrivals.arrival_offsets`` with the same seed, and the metrics come from the same
``metrics.compute``; so a simulated and a measured run of one command line compare request by
request. Result files say ``"backend": "pdserve-sim"``, ``"simulated": true`` and the profile.
Workers share the machine's cores as the OS would schedule them (``--pin-cores`` is not
modelled), and nothing else runs on the machine (other tenants are not modelled either).
Bad input exits with code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tqdm import tqdm

from pdserve.bench import plots, results, serve, serve_plan, workloads
from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import compute
from pdserve.engine.kv_cache import parse_memory
from pdserve.planner.profile import Profile
from pdserve.planner.sim_topology import SimConfig, Topology
from pdserve.planner.simulator import simulate

PROG = "pdserve simulate"
DEFAULT_MODES = "1p1d,colocated"


def build_parser() -> argparse.ArgumentParser:
    parser = serve_plan.build_parser()
    parser.prog = PROG
    parser.description = (
        "Simulated serving benchmark: pdserve bench's options and result files, from a profile "
        "(pdserve profile) instead of started stacks; --profile is required"
    )
    for action in parser._actions:  # bench's options that speak of a live stack or transformers
        if action.dest == "modes":
            action.default = DEFAULT_MODES
            action.help = f"comma-separated stack modes: colocated, NpMd (e.g. 1p1d, 2p1d) (default: {DEFAULT_MODES})"
        elif action.dest in ("addr", "connect_timeout_s", "hf_batch_size", "hf_dtype"):
            action.help = argparse.SUPPRESS
    return parser


def topology(mode: serve_plan.Mode, plan: serve_plan.Plan) -> Topology:
    return Topology(
        prefill=mode.prefill,
        decode=mode.decode,
        colocated=mode.colocated,
        conditional=mode.conditional,
        policy=mode.policy or plan.policy or "kv_aware",
        chunked_prefill=mode.chunked_prefill,
    )


def sim_config(plan: serve_plan.Plan, profile: Profile) -> SimConfig:
    """The settings of the stacks ``pdserve bench`` would start with the same flags."""
    e = plan.engine
    if e.kv_cache_dtype != profile.kv_cache_dtype:  # its KV bytes per token and transfer times are another format's
        raise ValueError(
            f"--kv-cache-dtype {e.kv_cache_dtype}: the profile was measured with kv_cache_dtype "
            f"{profile.kv_cache_dtype}; profile again with --kv-cache-dtype {e.kv_cache_dtype}"
        )
    nbytes, _ = parse_memory(e.kv_cache_memory) if e.kv_cache_memory != "auto" else (None, None)
    if nbytes is not None and nbytes < profile.kv_bytes_per_token * e.block_size:
        raise ValueError(f"--kv-cache-memory {e.kv_cache_memory} holds no block of {e.block_size} tokens")
    return SimConfig(
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        block_size=e.block_size,
        enable_prefix_caching=e.enable_prefix_caching,
        num_threads=e.num_threads,
        kv_cache_tokens=nbytes // profile.kv_bytes_per_token if nbytes else None,
        slo_tpot_ms=plan.slo_tpot_ms,
        conditional_threshold_tokens=plan.conditional_threshold_tokens,
        request_timeout_s=plan.request_timeout_s,
        time_limit_s=plan.time_limit_s,
        max_concurrency=plan.max_concurrency,
    )


def run(plan: serve_plan.Plan, profile: Profile, specs: list[workloads.RequestSpec]) -> list[dict]:
    config = sim_config(plan, profile)
    collected = []
    runs = [(mode, k, rate) for mode in plan.modes for k, rate in enumerate(plan.rates)]
    for mode, k, rate in tqdm(runs, desc="simulating", unit="run", disable=not plan.progress, leave=False):
        sim = simulate(
            profile,
            topology(mode, plan),
            workloads.variant(specs, k),
            arrival_offsets(len(specs), rate, plan.burstiness, plan.seed),
            config,
        )
        info = dataclasses.replace(serve._info(plan, mode, rate, k), backend="pdserve-sim")
        metrics = compute(sim.timelines, sim.duration, plan.goodput)
        result = results.to_result(info, metrics, sim.timelines)
        result.update(
            {
                "simulated": True,
                "profile": plan.profile,
                "profile_source": profile.source,
                "sim_counters": dict(sim.counters),
            }
        )
        path = results.write(plan.result_dir, info, result)
        print(
            f"[{mode.label} @ {result['request_rate']}] simulated: {metrics.completed} ok, {metrics.failed} failed, "
            f"{sim.duration:.2f} s -> {path}",
            file=sys.stderr,
            flush=True,
        )
        collected.append(result)
    return collected


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.profile:
            raise ValueError("--profile FILE is required (make one with: pdserve profile --output FILE)")
        plan = serve_plan.make_plan(args)
        for m in plan.modes:
            if m.kind != "stack":
                raise ValueError(
                    f"mode {m.label} is not a pdserve stack and cannot be simulated; give colocated or NpMd modes"
                )
            if (m.speculative or plan.engine.speculative) != "none":
                raise ValueError(f"mode {m.label} cannot be simulated (speculative decoding is not modelled)")
        profile = Profile.load(plan.profile)
        sim_config(plan, profile)  # refuses settings no stack would start with
        specs = workloads.build(plan.workload, lambda: serve._tokenizer(plan.engine))
        profile.check_fits(specs)
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    collected = run(plan, profile, specs)
    results.print_tables(collected)
    if plan.plots and collected:
        for path in plots.write_all(collected, plan.result_dir):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
