"""``pdserve plan``: how many prefill and decode workers for a workload, SLOs and a device budget.

    pdserve plan --profile cpu.json --workload mixed --slo ttft:4000 tpot:50 --devices 2
    pdserve plan --profile a100-opt13b.json --workload sharegpt --slo ttft:200 tpot:100 --devices 64 --request-rate 20

The workload options are ``pdserve bench``'s. A profile from any machine plans for that
machine's kind (a GPU profile taken elsewhere plans a GPU fleet). Prints every candidate
unit with its estimate and, for the simulated ones, goodput per device and latency
percentiles, then the plan; ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from pdserve.bench import results, serve_plan, workloads
from pdserve.bench.metrics import Goodput, RunMetrics
from pdserve.planner.planner import FleetPlan, UnitResult, plan
from pdserve.planner.profile import Profile
from pdserve.planner.sim_topology import SimConfig

PROG = "pdserve plan"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Prefill/decode worker counts (and degrees) with the most goodput "
        "per device, from a profile and a simulated workload",
    )
    p.add_argument("--profile", required=True, help="a profile (pdserve profile --output FILE, or one built elsewhere)")
    p.add_argument("--slo", nargs="+", required=True, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--devices", type=int, required=True, help="device budget: GPUs, or CPU cores of one machine")
    p.add_argument(
        "--request-rate", type=float, default=None, help="the load to serve (req/s): how many units it needs"
    )
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs (default: 0.9)"
    )
    p.add_argument("--max-unit-devices", type=int, default=8, help="largest unit searched (default: 8)")
    p.add_argument("--top-k", type=int, default=6, help="candidates simulated, best estimates first (default: 6)")
    p.add_argument("--no-conditional", action="store_true", help="leave conditional disaggregation out of the search")
    p.add_argument("--num-prompts", type=int, default=200, help="simulated requests per run (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (default: 1, Poisson)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running batch per instance (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per step (default: 1024)")
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="size prefill chunks of mixing instances for this TPOT (default: the tpot SLO)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the plan and every candidate here")
    p.add_argument("--disable-tqdm", action="store_true")
    serve_plan.add_workload_arguments(p.add_argument_group("workload (as pdserve bench)"))
    return p


def _percentiles(m: RunMetrics | None) -> dict | None:
    if m is None:
        return None
    return {
        "ttft_p50_ms": m.ttft.median,
        "ttft_p99_ms": m.ttft.p99,
        "tpot_p50_ms": m.tpot.median,
        "tpot_p99_ms": m.tpot.p99,
        "itl_p99_ms": m.itl.p99,
        "request_goodput": m.request_goodput,
    }


def unit_summary(u: UnitResult) -> dict:
    return {
        "unit": u.label,
        "prefill": u.topology.prefill,
        "decode": u.topology.decode,
        "colocated": u.topology.colocated,
        "conditional": u.topology.conditional,
        "prefill_degree": u.topology.prefill_degree,
        "decode_degree": u.topology.decode_degree,
        "devices": u.devices,
        "estimate_rps": u.estimate,
        "goodput_rps": u.goodput,
        "goodput_per_device": u.per_device if u.goodput is not None else None,
        "at_goodput": _percentiles(u.metrics),
    }


def to_json(fleet: FleetPlan, profile: Profile, slo: Goodput, attainment: float) -> dict:
    return {
        "profile": {
            "model": profile.model,
            "device": profile.device,
            "parallel": profile.parallel,
            "source": profile.source,
        },
        "slo_ms": slo.as_dict(),
        "attainment": attainment,
        "budget": fleet.budget,
        "unit": unit_summary(fleet.unit),
        "replicas": fleet.replicas,
        "devices_used": fleet.devices,
        "goodput_rps": fleet.goodput,
        "target_rate": fleet.target_rate,
        "replicas_for_target": fleet.replicas_for_target,
        "target_unit": unit_summary(fleet.target_unit) if fleet.target_unit else None,
        "at_target": _percentiles(fleet.at_target),
        "candidates": [unit_summary(u) for u in fleet.candidates],
    }


def render(fleet: FleetPlan, profile: Profile, slo: Goodput, attainment: float) -> str:
    kind = "GPUs" if profile.parallel == "tensor_parallel" else "cores"
    lines = [
        f"profile: {profile.model} on {profile.device}",
        f"SLO: {slo.as_dict()} ms for {attainment:.0%} of requests",
        "",
        f"{'unit':34s} {kind:>5s} {'estimate':>9s} {'goodput':>8s} {'/device':>8s} {'TTFT p50':>9s} "
        f"{'TTFT p99':>9s} {'TPOT p99':>9s}",
    ]
    for u in fleet.candidates:
        if u.goodput is None:
            continue
        m = u.metrics
        cells = f"{m.ttft.median:9.0f} {m.ttft.p99:9.0f} {m.tpot.p99:9.1f}" if m else f"{'-':>9s} {'-':>9s} {'-':>9s}"
        lines.append(f"{u.label:34s} {u.devices:5d} {u.estimate:9.2f} {u.goodput:8.2f} {u.per_device:8.3f} {cells}")
    skipped = sum(u.goodput is None for u in fleet.candidates)
    lines.append(f"({skipped} more candidates estimated, not simulated; --json lists them)")
    u = fleet.unit
    if not fleet.goodput:
        lines += [
            "",
            f"no placement within {fleet.budget} {kind} meets the SLOs for {attainment:.0%} of the requests "
            "at any rate: loosen the SLOs or lower --attainment",
        ]
        return "\n".join(lines)
    lines += [
        "",
        f"plan for {fleet.budget} {kind}: {fleet.replicas} x [{u.label}] = {fleet.devices} {kind}, "
        f"goodput {fleet.goodput:.2f} req/s ({u.per_device:.3f} per device)",
    ]
    if fleet.target_rate is not None:
        if fleet.replicas_for_target is None:
            lines.append(f"target {fleet.target_rate:g} req/s: no unit meets the SLOs at any rate")
        else:
            need, t = fleet.replicas_for_target, fleet.target_unit
            devices = need * t.devices
            fits = "fits the budget" if devices <= fleet.budget else "over the budget"
            lines.append(f"target {fleet.target_rate:g} req/s: {need} x [{t.label}] = {devices} {kind} ({fits})")
            if fleet.at_target:
                m = fleet.at_target
                lines.append(
                    f"  predicted per unit: TTFT p50 {m.ttft.median:.0f} ms, p99 {m.ttft.p99:.0f} ms; "
                    f"TPOT p50 {m.tpot.median:.1f} ms, p99 {m.tpot.p99:.1f} ms; ITL p99 {m.itl.p99:.1f} ms"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        slo = Goodput.parse(args.slo, "--slo")
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
        if args.devices < 1 or args.max_unit_devices < 1 or args.top_k < 1:
            raise ValueError("--devices, --max-unit-devices and --top-k must be >= 1")
        if args.slo_tpot_ms is not None and not (args.slo_tpot_ms > 0 and math.isfinite(args.slo_tpot_ms)):
            raise ValueError(f"--slo-tpot-ms must be a positive number of ms, got {args.slo_tpot_ms}")
        if args.request_rate is not None and not (args.request_rate > 0 and math.isfinite(args.request_rate)):
            raise ValueError(f"--request-rate must be a positive number of requests/s, got {args.request_rate}")
        if args.json:
            results.check_output_file(args.json, "--json")
        profile = Profile.load(args.profile)
        specs = workloads.build(serve_plan.workload_config(args), lambda: _tokenizer())
        profile.check_fits(specs)
        config = SimConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            slo_tpot_ms=slo.tpot_ms if args.slo_tpot_ms is None else args.slo_tpot_ms,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    bar = tqdm(desc="simulating units", unit="unit", disable=args.disable_tqdm, leave=False)
    try:
        fleet = plan(
            profile,
            specs,
            slo,
            args.devices,
            target_rate=args.request_rate,
            attainment_target=args.attainment,
            max_unit_devices=args.max_unit_devices,
            top_k=args.top_k,
            conditional=not args.no_conditional,
            config=config,
            burstiness=args.burstiness,
            seed=args.seed,
            progress=lambda label: (bar.set_postfix_str(label), bar.update()),
        )
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    print(render(fleet, profile, slo, args.attainment))
    if args.json:
        args.json.write_text(json.dumps(to_json(fleet, profile, slo, args.attainment), indent=1))
    return 0


def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


if __name__ == "__main__":
    sys.exit(main())
