"""What ``pdserve bench`` runs: its modes (``--modes``), its command line, and the ``Plan`` the
command line resolves to (``serve.py`` runs it; ``pdserve simulate`` and ``pdserve plan``
share the parser and the workload options)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import results, workloads
from pdserve.bench.arrivals import parse_rates
from pdserve.bench.arrivals import validate as validate_arrivals
from pdserve.bench.hf_baseline import DTYPES as HF_DTYPES
from pdserve.bench.metrics import DEFAULT_SHORT_THRESHOLD, Goodput
from pdserve.client import DEFAULT_ADDRESS
from pdserve.config import add_arguments, resolve
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.settings import KV_TRANSPORTS, ROUTING_POLICIES, ClusterSettings, WorkerSettings

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
    hf_dtype: str | None  # None: the stacks' --dtype
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
        "--hf-dtype",
        default=None,
        choices=("auto", *HF_DTYPES),
        help="the hf baseline's dtype, to run it at its own best (default: the stacks' --dtype)",
    )
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
    if args.dataset_path is not None and args.workload != "jsonl":
        raise ValueError(
            f"--dataset-path is read by the jsonl workload only; {args.workload!r} is generated here "
            "(for a dataset file, write one JSON object per line with 'prompt' and 'output_len' and "
            "give --workload jsonl)"
        )
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
        ("--seed", args.seed, 0),
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
    results.check_result_dir(Path(args.result_dir))
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
        hf_dtype=args.hf_dtype,
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
