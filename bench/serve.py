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

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Iterator  # noqa: E402

from pdserve.bench import plots, results, workloads  # noqa: E402
from pdserve.bench.arrivals import parse_rates  # noqa: E402
from pdserve.bench.arrivals import validate as validate_arrivals
from pdserve.bench.client_load import (  # noqa: E402
    LoadConfig,
    Unreachable,
    check_reachable,
    fetch_cluster_stats,
    run_load,
    warm_up,
)
from pdserve.bench.metrics import DEFAULT_SHORT_THRESHOLD, Goodput, cluster_delta, compute  # noqa: E402
from pdserve.client import DEFAULT_ADDRESS  # noqa: E402
from pdserve.config import add_arguments, resolve  # noqa: E402
from pdserve.engine.engine_config import EngineConfig  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.process import free_port  # noqa: E402
from pdserve.settings import KV_TRANSPORTS, ROUTING_POLICIES, ClusterSettings, RouterSettings, WorkerSettings  # noqa: E402

MODE_SYNTAX = (
    "live, hf, colocated or NpMd (e.g. 1p1d, 2p1d), the last two optionally followed by "
    f"-POLICY ({', '.join(ROUTING_POLICIES)}), -nochunk and/or -ngram or -draft (speculative decoding), NpMd also by -conditional"
)
SPECULATIVE_SUFFIXES = ("ngram", "draft")
MAX_WORKERS_PER_ROLE = 16
PROG = "pdserve bench"
_TOPOLOGY = re.compile(r"(\d+)p(\d+)d")


@dataclass(frozen=True, slots=True)
class Mode:
    """One entry of ``--modes``."""

    label: str
    kind: str  # live, hf or stack (started by the benchmark)
    prefill: int = 0
    decode: int = 1
    colocated: bool = False
    policy: str | None = None  # None: --policy, else the router's default
    chunked_prefill: bool = True  # False: -nochunk
    conditional: bool = False  # -conditional: decode workers prefill short prompts themselves
    speculative: str | None = None  # -ngram, -draft: speculative decoding (None: --speculative)


def parse_mode(text: str) -> Mode:
    """'2p1d-round_robin-nochunk' -> Mode; raises ValueError naming the mode and the syntax."""
    label = text.strip()
    base, *suffixes = label.split("-")
    if base in ("live", "hf"):
        if suffixes:
            raise ValueError(f"mode {label}: {base} takes no suffix; modes are {MODE_SYNTAX}")
        return Mode(label, base)
    if base == "colocated":
        mode = Mode(label, "stack", prefill=0, decode=1, colocated=True)
    elif m := _TOPOLOGY.fullmatch(base):
        prefill, decode = int(m[1]), int(m[2])
        if not (1 <= prefill <= MAX_WORKERS_PER_ROLE and 1 <= decode <= MAX_WORKERS_PER_ROLE):
            raise ValueError(f"mode {label}: need 1 to {MAX_WORKERS_PER_ROLE} prefill and decode workers")
        mode = Mode(label, "stack", prefill=prefill, decode=decode)
    else:
        raise ValueError(f"unknown mode {label or '(empty)'}; modes are {MODE_SYNTAX}")
    for suffix in suffixes:
        if suffix in ROUTING_POLICIES and mode.policy is None:
            mode = dataclasses.replace(mode, policy=suffix)
        elif suffix == "nochunk" and mode.chunked_prefill:
            mode = dataclasses.replace(mode, chunked_prefill=False)
        elif suffix == "conditional" and not mode.conditional and not mode.colocated:
            mode = dataclasses.replace(mode, conditional=True)
        elif suffix in SPECULATIVE_SUFFIXES and mode.speculative is None:
            mode = dataclasses.replace(mode, speculative=suffix)
        else:
            raise ValueError(f"unknown mode {label}: bad or repeated suffix -{suffix}; modes are {MODE_SYNTAX}")
    return mode


def parse_modes(text: str) -> tuple[Mode, ...]:
    modes = tuple(parse_mode(m) for m in text.split(",") if m.strip())
    if not modes:
        raise ValueError(f"no mode given; modes are {MODE_SYNTAX}")
    labels = [m.label for m in modes]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"mode {', '.join(dup)} given twice (the mode is the label of its results)")
    return modes


@dataclass(frozen=True, slots=True)
class Plan:
    modes: tuple[Mode, ...]
    address: str
    rates: tuple[float, ...]
    burstiness: float
    max_concurrency: int | None
    seed: int
    warmup: int
    goodput: Goodput
    result_dir: Path
    time_limit_s: float
    request_timeout_s: float
    connect_timeout_s: float
    hf_batch_size: int
    temperature: float
    top_p: float
    progress: bool
    plots: bool
    workload: workloads.WorkloadConfig
    short_threshold: int
    policy: str | None
    profile: str | None
    slo_tpot_ms: float | None
    conditional_threshold_tokens: int | None
    engine: EngineConfig
    worker: WorkerSettings
    cluster: ClusterSettings


def add_workload_arguments(wl) -> None:
    """The workload options (shared with pdserve simulate and pdserve plan)."""
    wl.add_argument(
        "--workload",
        "--dataset-name",
        dest="workload",
        default="random",
        help=f"one of {', '.join(workloads.WORKLOADS)} (default: random)",
    )
    wl.add_argument("--dataset-path", default=None, help="JSONL file for the jsonl workload")
    wl.add_argument("--input-len", default=None, help="input tokens, N or LO:HI (per-workload default)")
    wl.add_argument("--output-len", default=None, help="output tokens, N or LO:HI (per-workload default)")
    wl.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts (default: 4)")
    wl.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: tokens per system prompt (default: 256)"
    )
    wl.add_argument(
        "--long-fraction",
        type=float,
        default=workloads.MIXED_LONG_FRACTION,
        help="mixed: share of long requests (default: %(default)s); --input-len/--output-len set the short ones",
    )
    wl.add_argument(
        "--long-input-len",
        default=None,
        help="mixed: input tokens of the long requests, N or LO:HI (default: %d:%d)" % workloads.MIXED_LONG_INPUT,
    )
    wl.add_argument(
        "--long-output-len",
        default=None,
        help="mixed: output tokens of the long requests, N or LO:HI (default: %d:%d)" % workloads.MIXED_LONG_OUTPUT,
    )
    wl.add_argument(
        "--short-threshold",
        type=int,
        default=DEFAULT_SHORT_THRESHOLD,
        help="prompts shorter than this many tokens are 'short' in the TTFT split (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="TTFT/TPOT/ITL serving benchmark (vLLM metric definitions)")
    load = p.add_argument_group("load")
    load.add_argument(
        "--addr", default=DEFAULT_ADDRESS, help="router of a live stack, for mode live (default: %(default)s)"
    )
    load.add_argument(
        "--modes",
        default="live",
        help=f"comma-separated: {MODE_SYNTAX}; all but live and hf start their own stack (default: live)",
    )
    load.add_argument(
        "--request-rates",
        "--request-rate",
        dest="request_rates",
        default="inf",
        help="comma-separated req/s to sweep, or inf = all at once (default: inf)",
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson, <1 burstier")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (rate inf: fixed concurrency)"
    )
    load.add_argument("--num-prompts", type=int, default=100, help="measured requests per run (default: 100)")
    load.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    load.add_argument(
        "--warmup",
        "--num-warmups",
        dest="warmup",
        type=int,
        default=2,
        help="uncounted requests before each mode's sweep (default: 2)",
    )
    load.add_argument(
        "--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)"
    )
    load.add_argument(
        "--time-limit-s", type=float, default=600.0, help="limit per run, one mode at one rate (default: 600)"
    )
    load.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of each request (default: 120)")
    load.add_argument(
        "--connect-timeout-s", type=float, default=10.0, help="wait for the router to accept (default: 10)"
    )
    load.add_argument("--hf-batch-size", type=int, default=8, help="static batch of the hf baseline (default: 8)")
    load.add_argument(
        "--temperature", type=float, default=0.0, help="every request's temperature, hf included (default: 0, greedy)"
    )
    load.add_argument("--top-p", type=float, default=1.0, help="every request's top_p, hf included (default: 1)")
    load.add_argument("--result-dir", default="bench/results", help="JSON files and PNG plots (default: %(default)s)")
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    load.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    add_workload_arguments(p.add_argument_group("workload"))
    stack = p.add_argument_group("stacks started by the benchmark (and the hf baseline)")
    add_arguments(stack, EngineConfig)
    stack.add_argument("--kv-transport", default=None, choices=KV_TRANSPORTS, help="KV transport of the started stacks")
    stack.add_argument(
        "--policy",
        default=None,
        choices=ROUTING_POLICIES,
        help="routing policy of a started stack whose mode names none (default: kv_aware)",
    )
    stack.add_argument(
        "--pin-cores", action=argparse.BooleanOptionalAction, default=None, help="pin each worker to its own cores"
    )
    stack.add_argument("--startup-timeout-s", type=float, default=None, help="wait for a started stack (default: 300)")
    stack.add_argument(
        "--profile",
        default=None,
        help="a profile (pdserve profile) for started stacks: the conditional threshold and, with "
        "--slo-tpot-ms, prefill chunks sized from it",
    )
    stack.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="started stacks keep a step that mixes prefill and decode within this many ms (needs --profile)",
    )
    stack.add_argument(
        "--conditional-threshold-tokens",
        type=int,
        default=None,
        help="-conditional stacks: uncached prompt tokens a decode worker always prefills (default: from --profile)",
    )
    return p


def workload_config(args: argparse.Namespace) -> workloads.WorkloadConfig:
    return workloads.WorkloadConfig(
        name=args.workload,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=workloads.parse_range(args.input_len) if args.input_len else None,
        output_len=workloads.parse_range(args.output_len) if args.output_len else None,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        long_fraction=args.long_fraction,
        long_input_len=workloads.parse_range(args.long_input_len)
        if args.long_input_len
        else workloads.MIXED_LONG_INPUT,
        long_output_len=workloads.parse_range(args.long_output_len)
        if args.long_output_len
        else workloads.MIXED_LONG_OUTPUT,
    )


def make_plan(args: argparse.Namespace) -> Plan:
    """Validates every input up front; raises ValueError with the message for the user."""
    modes = parse_modes(args.modes)
    rates = tuple(parse_rates(args.request_rates))
    validate_arrivals(math.inf, args.burstiness)
    counts = (
        ("--num-prompts", args.num_prompts, 1),
        ("--warmup", args.warmup, 0),
        ("--hf-batch-size", args.hf_batch_size, 1),
        ("--short-threshold", args.short_threshold, 1),
    )
    for name, value, low in counts:
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if args.slo_tpot_ms is not None and not (args.slo_tpot_ms > 0 and math.isfinite(args.slo_tpot_ms)):
        raise ValueError(f"--slo-tpot-ms must be a positive number of milliseconds, got {args.slo_tpot_ms}")
    if args.slo_tpot_ms is not None and not args.profile:
        raise ValueError("--slo-tpot-ms sizes prefill chunks from a profile: give --profile FILE too")
    if args.conditional_threshold_tokens is not None and args.conditional_threshold_tokens < 0:
        raise ValueError(f"--conditional-threshold-tokens must be >= 0, got {args.conditional_threshold_tokens}")
    if args.profile:
        from pdserve.planner.profile import Profile

        Profile.load(args.profile)  # a bad profile is bad input, found before any stack starts
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # the server's rules, checked before it starts
    for name in ("time_limit_s", "request_timeout_s", "connect_timeout_s"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    wl = workload_config(args)
    engine = resolve(EngineConfig, args)
    if any(m.speculative == "draft" for m in modes) and not engine.draft_model:
        raise ValueError("a -draft mode needs the draft model: give --draft-model PATH")
    return Plan(
        modes=modes,
        address=args.addr,
        rates=rates,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        warmup=args.warmup,
        goodput=Goodput.parse(args.goodput),
        result_dir=Path(args.result_dir),
        time_limit_s=args.time_limit_s,
        request_timeout_s=args.request_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        hf_batch_size=args.hf_batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        progress=not args.disable_tqdm,
        plots=not args.no_plots,
        workload=wl,
        short_threshold=args.short_threshold,
        policy=args.policy,
        profile=args.profile,
        slo_tpot_ms=args.slo_tpot_ms,
        conditional_threshold_tokens=args.conditional_threshold_tokens,
        engine=engine,
        worker=resolve(WorkerSettings, args, env={}),
        cluster=resolve(ClusterSettings, args, env={}),
    )


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

    engine, router, cluster_settings = _stack_config(mode, plan, free_port())
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
        dtype=plan.engine.dtype,
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
