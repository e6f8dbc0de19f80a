"""TTFT/ITL serving benchmark: ``python bench/serve.py ...`` (``main(argv)`` for ``pdserve bench``).

Runs a workload against a live router (``--addr``), or starts each stack of ``--modes``
itself (one at a time: start, warm up, sweep the rates, stop), and/or runs the Hugging Face
``generate`` baseline (hf) on the same requests. Writes one vLLM-style JSON per mode and rate
and the PNG plots to ``--result-dir`` and prints tables.

Modes (the mode string is the label in tables, plots and file names):
- ``live``: the router at ``--addr``; ``hf``: the Hugging Face baseline.
- ``NpMd``: a started stack of N prefill and M decode workers (``1p1d``, ``2p1d``, ...).
- ``colocated``: a started stack of one worker that prefills and decodes.
- A started stack's name may be followed by ``-<policy>`` (round_robin, least_loaded,
  kv_aware; default ``--policy``, else kv_aware) and/or ``-nochunk`` (chunked prefill off in
  every worker), e.g. ``2p1d-kv_aware``, ``2p1d-round_robin``, ``1p1d-nochunk``,
  ``colocated-nochunk``; an ``NpMd`` stack also by ``-conditional`` (conditional
  disaggregation: decode workers prefill short prompts themselves), e.g. ``1p1d-conditional``;
  and either by ``-ngram`` or ``-draft`` (speculative decoding in its decoding workers, with
  ``--num-speculative-tokens`` and, for ``-draft``, ``--draft-model``), e.g.
  ``colocated,colocated-ngram`` side by side.
  ``--profile`` gives started stacks a profile (the conditional threshold; with
  ``--slo-tpot-ms``, prefill chunks sized so a mixed step stays within it). ``--pin-cores`` pins the workers of every started stack (1p1d on 2
  cores: one core each; colocated: its one worker gets both).

Each rate of a sweep sends a variant of the workload (``workloads.variant``: same lengths,
same sharing, no prompt block in common with the other rates), so a later rate does not
find the earlier rate's prompts in the prefix cache. Around each run on a started or live
stack the router's ``GetClusterStats`` is read, and the prefix-cache hit rate and the
migrations/retries over the run go into the results.
Bad input exits with code 2 and a one-line message; a stack that fails to start exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder would shadow top-level modules (e.g. a library's 'metrics').
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from typing import Iterator  # noqa: E402

from pdserve.bench import plots, results, workloads  # noqa: E402
from pdserve.bench.client_load import (  # noqa: E402
    LoadConfig,
    Unreachable,
    check_reachable,
    fetch_cluster_stats,
    run_load,
    warm_up,
)
from pdserve.bench.metrics import cluster_delta, compute  # noqa: E402
from pdserve.bench.serve_plan import PROG, Mode, Plan, build_parser, make_plan  # noqa: E402
from pdserve.engine.engine_config import EngineConfig  # noqa: E402
from pdserve.settings import ClusterSettings, RouterSettings  # noqa: E402


def _tokenizer(engine: EngineConfig):
    from transformers import AutoTokenizer

    from pdserve.engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(engine.model, engine.cache_dir)))


def _stack_config(mode: Mode, plan: Plan, port: int = 0) -> tuple[EngineConfig, RouterSettings, ClusterSettings]:
    """The settings of the stack a mode starts: --flags, then what the mode name says."""
    engine = plan.engine if mode.chunked_prefill else dataclasses.replace(plan.engine, enable_chunked_prefill=False)
    if mode.speculative is not None:
        engine = dataclasses.replace(engine, speculative=mode.speculative)
    router = RouterSettings(
        host="127.0.0.1",
        port=port,
        policy=mode.policy or plan.policy or RouterSettings.policy,
        conditional=mode.conditional,
        profile=plan.profile,
        slo_tpot_ms=plan.slo_tpot_ms,
        conditional_threshold_tokens=plan.conditional_threshold_tokens,
    )
    cluster = ClusterSettings(
        prefill=mode.prefill,
        decode=mode.decode,
        colocated=mode.colocated,
        pin_cores=plan.cluster.pin_cores,
        startup_timeout_s=plan.cluster.startup_timeout_s,
    )
    return engine, router, cluster


def _stack_info(mode: Mode, plan: Plan) -> dict | None:
    if mode.kind != "stack":
        return None
    engine, router, cluster = _stack_config(mode, plan)
    return {
        "prefill_workers": cluster.prefill,
        "decode_workers": cluster.decode,
        "colocated": cluster.colocated,
        "policy": router.policy,
        "chunked_prefill": engine.enable_chunked_prefill,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "pin_cores": cluster.pin_cores,
        "conditional": router.conditional,
        "profile": router.profile,
        "slo_tpot_ms": router.slo_tpot_ms,
        "speculative": engine.speculative,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "draft_model": engine.draft_model if engine.speculative == "draft" else None,
    }


@contextlib.contextmanager
def _stack(mode: Mode, plan: Plan) -> Iterator[str]:
    """The router address for ``mode``; a started stack is stopped on the way out, always."""
    if mode.kind == "live":
        yield plan.address
        return
    from pdserve.launcher import Cluster

    engine, router, cluster_settings = _stack_config(mode, plan)  # port 0: the router binds one itself
    # Keep worker logs out of the tables (unless the caller asked for a level).
    quiet = {"PDSERVE_LOG_LEVEL": os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")}
    cluster = Cluster(engine, plan.worker, router, cluster_settings, env=quiet)
    print(f"[{mode.label}] starting the stack ...", file=sys.stderr, flush=True)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        print(f"[{mode.label}] stack stopped", file=sys.stderr, flush=True)


def _info(plan: Plan, mode: Mode, rate: float, variant: int = 0) -> results.RunInfo:
    backend = "hf-generate" if mode.kind == "hf" else "pdserve-grpc"
    return results.RunInfo(
        mode=mode.label,
        backend=backend,
        model_id=plan.engine.model or "default",
        workload=plan.workload.name,
        num_prompts=plan.workload.num_prompts,
        request_rate=rate,
        burstiness=plan.burstiness,
        max_concurrency=None if backend != "pdserve-grpc" else plan.max_concurrency,
        seed=plan.seed,
        goodput=plan.goodput,
        short_threshold=plan.short_threshold,
        stack=_stack_info(mode, plan),
        prompt_variant=variant,
        temperature=plan.temperature,
        top_p=plan.top_p,
    )


def _record(plan: Plan, info: results.RunInfo, timelines, duration: float, cluster: dict | None = None) -> dict:
    metrics = compute(timelines, duration, plan.goodput)
    result = results.to_result(info, metrics, timelines, cluster)
    path = results.write(plan.result_dir, info, result)
    hit = "" if result["prefix_hit_rate"] is None else f", prefix hit {result['prefix_hit_rate']:.1%}"
    print(
        f"[{info.mode} @ {result['request_rate']}] {metrics.completed} ok, {metrics.failed} failed, "
        f"{duration:.2f} s{hit} -> {path}",
        file=sys.stderr,
        flush=True,
    )
    return result


async def _sweep(plan: Plan, mode: Mode, address: str, specs: list[workloads.RequestSpec]) -> list[dict]:
    await check_reachable(address, plan.connect_timeout_s)
    if plan.warmup:
        warm = await warm_up(address, workloads.warmup_specs(specs, plan.warmup, plan.seed), plan.request_timeout_s)
        bad = [t.error for t in warm if not t.success]
        if bad:
            print(
                f"[{mode.label}] warning: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}", file=sys.stderr
            )
    out = []
    for k, rate in enumerate(plan.rates):
        cfg = LoadConfig(
            address=address,
            request_rate=rate,
            burstiness=plan.burstiness,
            max_concurrency=plan.max_concurrency,
            seed=plan.seed,
            request_timeout_s=plan.request_timeout_s,
            time_limit_s=plan.time_limit_s,
            progress=plan.progress,
            label=f"{mode.label} @ {rate:g} req/s",
            temperature=plan.temperature,
            top_p=plan.top_p,
        )
        before = await fetch_cluster_stats(address, plan.connect_timeout_s)
        load = await run_load(workloads.variant(specs, k), cfg)
        after = await fetch_cluster_stats(address, plan.connect_timeout_s) if before is not None else None
        if after is None:
            print(
                f"[{mode.label}] warning: the router's cluster stats could not be read; no prefix hit rate",
                file=sys.stderr,
                flush=True,
            )
        cluster = cluster_delta(before, after) if before is not None and after is not None else None
        out.append(_record(plan, _info(plan, mode, rate, k), load.timelines, load.duration, cluster))
    return out


def _run_hf(plan: Plan, specs: list[workloads.RequestSpec]) -> dict:
    from pdserve.bench.hf_baseline import HFConfig, run_hf

    cfg = HFConfig(
        model=plan.engine.model,
        dtype=plan.hf_dtype or plan.engine.dtype,
        batch_size=plan.hf_batch_size,
        time_limit_s=plan.time_limit_s,
        cache_dir=plan.engine.cache_dir,
        num_threads=plan.engine.num_threads,
        progress=plan.progress,
        temperature=plan.temperature,
        top_p=plan.top_p,
    )
    print("[hf] loading the model ...", file=sys.stderr, flush=True)
    res = run_hf(specs, cfg)
    return _record(plan, _info(plan, Mode("hf", "hf"), math.inf), res.timelines, res.duration)


def run(plan: Plan, specs: list[workloads.RequestSpec]) -> tuple[list[dict], list[str]]:
    """Runs every mode; a mode that fails (e.g. its stack does not start) is reported and
    skipped so the others still run. Returns the results and the failed modes' messages."""
    if any(m.kind == "live" for m in plan.modes):  # fail fast, before starting anything
        asyncio.run(check_reachable(plan.address, plan.connect_timeout_s))
    collected: list[dict] = []
    failures: list[str] = []
    for mode in plan.modes:
        try:
            if mode.kind == "hf":
                collected.append(_run_hf(plan, specs))
                continue
            with _stack(mode, plan) as address:
                collected += asyncio.run(_sweep(plan, mode, address, specs))
        except (RuntimeError, TimeoutError, OSError) as e:  # Unreachable is an OSError
            failures.append(f"mode {mode.label}: {e}")
            print(f"{PROG}: error: mode {mode.label}: {e}", file=sys.stderr, flush=True)
    results.print_tables(collected)
    if plan.plots and collected:
        for path in plots.write_all(collected, plan.result_dir):
            print(f"plot: {path}")
    return collected, failures


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
        specs = workloads.build(plan.workload, lambda: _tokenizer(plan.engine))
        if any(m.kind != "live" for m in plan.modes):  # a bad --model is bad input, not a stack that fails later
            from pdserve.engine.model_store import resolve_model

            resolve_model(plan.engine.model, plan.engine.cache_dir)
    except (ValueError, FileNotFoundError) as e:  # WorkloadError is a ValueError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        _, failures = run(plan, specs)
    except Unreachable as e:  # the live address, checked before anything runs
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
