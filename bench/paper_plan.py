"""A plan on paper: OPT-13B on A100 GPUs, from published figures, at 8, 64 and 1,024 GPUs.

    python bench/paper_plan.py --output bench/profiles/a100-opt13b-published.json --json plan.json

Builds a pdserve profile without measuring anything, from:

- step latencies: the latency model DistServe fitted to OPT-13B on A100-80GB GPUs and published
  with its simulator (github.com/LLMServe/DistServe, ``simdisagg/timemodule/worktime.py``,
  ``opt_13b_params``, keyed by (tensor parallel, pipeline parallel)): prefill
  ``a * sum(len) + b * sum(len^2) + c`` and decode ``a * sum(context) + b * batch + c``
  milliseconds. Here, at pipeline parallel 1 and tensor parallel 1, 2, 4: base = the decode
  intercept, per decode = its per-sequence term, per context token = its context term, per
  prompt token = the prefill linear term and per attention pair = twice the prefill quadratic
  term (a whole prompt of n tokens has n^2 / 2 pairs);
- KV cache size: OPT-13B has 40 layers and a hidden size of 5120 (Zhang et al., "OPT: Open
  Pre-trained Transformer Language Models", 2022, table 1), so fp16 K and V take
  2 x 40 x 5120 x 2 = 819,200 bytes per token; the cache is what 92% of 80 GB per GPU leaves
  after 12.85 B fp16 weights (DistServe runs at ``--gpu-memory-utilization 0.92``);
- KV handoff: NVLink 3 between A100s of one node, 300 GB/s each way (NVIDIA A100 datasheet:
  600 GB/s total); DistServe places a unit's prefill and decode instances on one node.

Then plans the chat workload (``sharegpt``, this repository's synthetic stand-in for ShareGPT
lengths) against the SLO of DistServe's own placement search for OPT-13B
(``simdisagg/benchmarks/simulate_dist.py``: TTFT 200 ms and TPOT 100 ms, 90% of requests),
at budgets of 8, 64 and 1,024 GPUs, and prints the plans beside DistServe's published placement
for OPT-13B (its serving script ``evaluation/2-benchmark-serving/2-start-api-server.py``,
``MODEL_TO_PARALLEL_PARAMS``: one 2-GPU prefill instance and one 1-GPU decoding instance).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402

from tqdm import tqdm  # noqa: E402

from pdserve.bench import workloads  # noqa: E402
from pdserve.bench.metrics import Goodput  # noqa: E402
from pdserve.planner import capacity  # noqa: E402
from pdserve.planner.plan_cli import unit_summary  # noqa: E402
from pdserve.planner.planner import UnitResult, best_fill, estimate, plan, unit_devices, unit_goodput  # noqa: E402
from pdserve.planner.profile import Overheads, Profile, StepCost, TransferCost  # noqa: E402
from pdserve.planner.sim_topology import SimConfig, Topology  # noqa: E402

# DistServe's OPT-13B / A100 fits at pipeline parallel 1: TP -> (prefill a, b, c), (decode a, b, c), ms.
DISTSERVE_OPT13B = {
    1: (
        (0.09482354604158061, 4.03088651711854e-06, 18.891404031181914),
        (0.0006109319663589057, 0.06818472528436295, 19.878099045083218),
    ),
    2: (
        (0.06373414217499217, 2.0426077577567835e-06, 17.73259930652419),
        (0.00036709471825591145, 0.018816958156899988, 17.350085537432527),
    ),
    4: (
        (0.0324359612452919, 1.4551978520879437e-06, 12.64555955944732),
        (0.0002088168996943625, -0.03482556407211749, 9.22092145851236),
    ),
}
KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2
WEIGHT_BYTES = 12.85e9 * 2
GPU_BYTES = 80e9 * 0.92
NVLINK_BYTES_PER_S = 300e9
SLO = Goodput(ttft_ms=200.0, tpot_ms=100.0)
BUDGETS = (8, 64, 1024)
DISTSERVE_UNIT = Topology(prefill=1, decode=1, prefill_degree=2, decode_degree=1)  # 2 + 1 GPUs


def published_profile() -> Profile:
    steps = {}
    for tp, ((pa, pb, _), (da, db, dc)) in DISTSERVE_OPT13B.items():
        steps[tp] = StepCost(base_ms=dc, decode_ms=db, prefill_ms=pa, decode_ctx_ms=da, prefill_attn_ms=2 * pb)
    return Profile(
        model="OPT-13B",
        device="NVIDIA A100-SXM4-80GB",
        parallel="tensor_parallel",
        steps=steps,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        transfers={"nvlink": TransferCost(0.0, 2**20 / NVLINK_BYTES_PER_S * 1e3)},
        transport="nvlink",
        overheads=Overheads(),
        dtype="float16",
        cores=None,
        max_model_len=2048,
        kv_cache_tokens={tp: int((tp * GPU_BYTES - WEIGHT_BYTES) // KV_BYTES_PER_TOKEN) for tp in steps},
        source="published figures: DistServe's OPT-13B A100 latency fits (github.com/LLMServe/DistServe, "
        "simdisagg/timemodule/worktime.py), OPT-13B shape (Zhang et al. 2022), A100 datasheet (80 GB, NVLink 600 GB/s)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None, help="also write the profile here")
    parser.add_argument("--json", type=Path, default=None, help="write the plans here")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--span-s", type=float, default=30.0, help="simulated seconds of arrivals per run")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.top_k < 1 or not args.span_s > 0:
        parser.error("--num-prompts and --top-k must be >= 1, --span-s > 0")
    profile = published_profile()
    if args.output:
        profile.save(args.output)
    specs = workloads.build(
        workloads.WorkloadConfig(name="sharegpt", num_prompts=args.num_prompts, seed=args.seed), lambda: None
    )
    config = SimConfig(max_num_seqs=256, max_num_batched_tokens=4096, slo_tpot_ms=SLO.tpot_ms)
    with tqdm(desc="units", unit="unit") as bar:
        fleet = plan(
            profile,
            specs,
            SLO,
            budget=8,
            max_unit_devices=8,
            top_k=args.top_k,
            config=config,
            seed=args.seed,
            span_s=args.span_s,
            progress=lambda label: (bar.set_postfix_str(label), bar.update()),
        )
        w = capacity.WorkloadStats.of(specs)
        guess = estimate(profile, DISTSERVE_UNIT, w, SLO, config.max_num_seqs)
        rate, metrics = unit_goodput(
            profile, DISTSERVE_UNIT, specs, SLO, 0.9, config, guess, seed=args.seed, span_s=args.span_s
        )
        theirs = UnitResult(DISTSERVE_UNIT, unit_devices(profile, DISTSERVE_UNIT), guess, rate, metrics)
    simulated = [u for u in fleet.candidates if u.goodput is not None] + [theirs]
    print(f"{'unit':34s} {'GPUs':>4s} {'goodput':>8s} {'/GPU':>6s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p99':>9s}")
    for u in sorted(simulated, key=lambda u: -u.per_device):
        m = u.metrics
        tail = f"{m.ttft.median:9.0f} {m.ttft.p99:9.0f} {m.tpot.p99:9.1f}" if m else ""
        print(f"{u.label:34s} {u.devices:4d} {u.goodput:8.2f} {u.per_device:6.2f} {tail}")
    plans = {}
    for budget in BUDGETS:
        best = best_fill(simulated, budget)
        n = budget // best.devices
        ours = n * best.goodput
        n_theirs = budget // theirs.devices
        plans[budget] = {
            "unit": unit_summary(best),
            "replicas": n,
            "gpus_used": n * best.devices,
            "goodput_rps": ours,
            "distserve_replicas": n_theirs,
            "distserve_goodput_rps": n_theirs * theirs.goodput,
        }
        print(
            f"{budget:5d} GPUs: {n} x [{best.label}] = {n * best.devices} GPUs, {ours:.1f} req/s; DistServe's placement: "
            f"{n_theirs} x [{theirs.label}] = {n_theirs * 3} GPUs, {n_theirs * theirs.goodput:.1f} req/s"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "profile": profile.source,
                    "slo_ms": SLO.as_dict(),
                    "plans": plans,
                    "units": [unit_summary(u) for u in simulated],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
