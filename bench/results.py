"""Result files and console tables.

A result is a flat dict that uses the key names of ``vllm bench serve`` result files (with
``--save-detailed``) wherever the metric exists there, so tools written for those files read
these; the additions are new keys: mode, workload, seed, goodput_slos_ms, p90_*, stack (the
topology a started stack had: workers, policy, chunked prefill, pinning; None for live and
hf), prompt_variant (``workloads.variant``), the TTFT split by prompt length
(short_threshold, num_short/num_long, short_ttft_p50_ms/p99, long_ttft_p50_ms/p99: None for
an empty class) and the router's counters over the run (prefix_hit_rate, prefix_cache per
role, migrations, retries, router_counters, speculative (drafts, draft_tokens,
accepted_tokens, acceptance_rate, mean_accepted_length: speculative decoding over the run),
cluster_stats_incomplete: None where the stats could not be read, e.g. hf). ITL per token
(``*_itl_per_token_ms``) splits each message's gap over its tokens (speculative decoding
streams several tokens per message). Latency statistics are in ms; the per-request ``ttfts`` and
``itls`` are in seconds, as in vLLM.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

from pdserve.bench.metrics import DEFAULT_SHORT_THRESHOLD, Goodput, RunMetrics, Timeline, ttft_by_length

LATENCY_METRICS = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL"),
    ("e2el", "E2EL"),
    ("itl_per_token", "ITL per token"),
)


@dataclass(frozen=True, slots=True)
class RunInfo:
    mode: str  # the --modes label: live, hf, colocated[-...], NpMd[-policy][-nochunk]
    backend: str  # pdserve-grpc or hf-generate
    model_id: str
    workload: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    goodput: Goodput
    short_threshold: int = DEFAULT_SHORT_THRESHOLD
    stack: dict | None = None  # a started stack's topology and settings
    prompt_variant: int = 0
    temperature: float = 0.0  # every request's sampling (0: greedy)
    top_p: float = 1.0


CLUSTER_KEYS = ("prefix_hit_rate", "prefix_cache", "migrations", "retries", "router_counters", "speculative")


def to_result(info: RunInfo, m: RunMetrics, timelines: list[Timeline], cluster: dict | None = None) -> dict:
    """``cluster``: ``metrics.cluster_delta`` over the run, or None when there is none."""
    result: dict = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend,
        "backend": info.backend,
        "label": info.mode,
        "model_id": info.model_id,
        "tokenizer_id": info.model_id,
        "num_prompts": info.num_prompts,
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "mode": info.mode,
        "workload": info.workload,
        "seed": info.seed,
        "goodput_slos_ms": info.goodput.as_dict() or None,
        "stack": info.stack,
        "prompt_variant": info.prompt_variant,
        "temperature": info.temperature,
        "top_p": info.top_p,
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "input_lens": [t.prompt_len for t in timelines],
        "output_lens": [t.output_tokens if t.success else 0 for t in timelines],
        "ttfts": [t.ttft if t.success else 0.0 for t in timelines],
        "itls": [t.itls if t.success else [] for t in timelines],
        "errors": [t.error for t in timelines],
        **ttft_by_length(timelines, info.short_threshold),
        **{k: (cluster or {}).get(k) for k in CLUSTER_KEYS},
        "cluster_stats_incomplete": None if cluster is None else cluster["incomplete"],
    }
    for key, _ in LATENCY_METRICS:
        for stat, value in asdict(getattr(m, key)).items():
            result[f"{stat}_{key}_ms"] = value  # mean_ttft_ms, median_ttft_ms, std_, p90_, p99_
    return result


def file_name(info: RunInfo) -> str:
    rate = "inf" if math.isinf(info.request_rate) else f"{info.request_rate:g}"
    conc = f"-concurrency{info.max_concurrency}" if info.max_concurrency else ""
    return f"{info.mode}-{rate}qps{conc}.json"


def check_result_dir(path: Path, flag: str = "--result-dir") -> None:
    """Makes the folder results go to, or refuses it naming ``flag``: before a run, not after."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}: cannot make folder {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{flag}: cannot write in {path}")


def check_output_file(path: Path, flag: str) -> None:
    """Refuses, before a run, a file that could not be written at its end."""
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a folder, not a file")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"{flag}: cannot write in {path.parent}")


def write(result_dir: Path, info: RunInfo, result: dict) -> Path:
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / file_name(info)
    path.write_text(json.dumps(result, indent=1))
    return path


def _table(header: list[str], rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    print(line, file=out)
    print("-" * len(line), file=out)
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=out)


def _rate(r: dict) -> str:
    rate = str(r["request_rate"])
    return rate + (f" c{r['max_concurrency']}" if r.get("max_concurrency") else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_tables(results: list[dict], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up per call, so redirected stdout (tests, callers) is honoured
    if not results:
        return
    print("\n== Throughput ==", file=out)
    rows = []
    for r in results:
        good = "-" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        rows.append(
            [
                r["mode"],
                _rate(r),
                str(r["completed"]),
                str(r["failed"]),
                f"{r['duration']:.2f}",
                str(r["total_input_tokens"]),
                str(r["total_output_tokens"]),
                f"{r['request_throughput']:.2f}",
                good,
                f"{r['output_throughput']:.1f}",
                f"{r['total_token_throughput']:.1f}",
                _pct(r.get("prefix_hit_rate")),
            ]
        )
    _table(
        [
            "mode",
            "rate",
            "ok",
            "failed",
            "time s",
            "in tok",
            "out tok",
            "req/s",
            "goodput",
            "out tok/s",
            "tot tok/s",
            "prefix hit",
        ],
        rows,
        out,
    )
    _cluster_table(results, out)
    if any(r.get("workload") == "mixed" for r in results):
        threshold = results[0].get("short_threshold", DEFAULT_SHORT_THRESHOLD)
        print(f"\n== TTFT by prompt length (ms; short: < {threshold} tokens) ==", file=out)
        rows = [
            [
                r["mode"],
                _rate(r),
                str(r.get("num_short", 0)),
                _ms(r.get("short_ttft_p50_ms")),
                _ms(r.get("short_ttft_p99_ms")),
                str(r.get("num_long", 0)),
                _ms(r.get("long_ttft_p50_ms")),
                _ms(r.get("long_ttft_p99_ms")),
            ]
            for r in results
        ]
        _table(["mode", "rate", "short n", "short p50", "short p99", "long n", "long p50", "long p99"], rows, out)
    for key, name in LATENCY_METRICS:
        print(f"\n== {name} (ms) ==", file=out)
        rows = [
            [r["mode"], _rate(r), *(f"{r[f'{s}_{key}_ms']:.1f}" for s in ("mean", "median", "p90", "p99"))]
            for r in results
        ]
        _table(["mode", "rate", "mean", "median", "p90", "p99"], rows, out)
    errors = [(r["mode"], _rate(r), e) for r in results for e in r["errors"] if e]
    if errors:
        print(f"\n{len(errors)} failed requests; first reasons:", file=out)
        for mode, rate, e in errors[:5]:
            print(f"  {mode} @ {rate}: {e}", file=out)


def _cluster_table(results: list[dict], out: TextIO) -> None:
    """Prefix cache hits/lookups per worker role and the router's migrations/retries, for the
    runs whose cluster stats were read."""
    with_stats = [r for r in results if r.get("prefix_cache") is not None]
    if not with_stats:
        return
    roles = sorted({role for r in with_stats for role in r["prefix_cache"]})
    print("\n== Cluster (over each run; prefix cache: blocks hit/looked up) ==", file=out)
    rows = []
    for r in with_stats:
        cells = []
        for role in roles:
            c = r["prefix_cache"].get(role)
            cells.append("-" if c is None else f"{c['hits']:.0f}/{c['queries']:.0f} {_pct(c['hit_rate'])}")
        incomplete = " (incomplete)" if r.get("cluster_stats_incomplete") else ""
        rows.append(
            [
                r["mode"],
                _rate(r),
                _pct(r["prefix_hit_rate"]) + incomplete,
                *cells,
                f"{r.get('migrations') or 0:.0f}",
                f"{r.get('retries') or 0:.0f}",
            ]
        )
    _table(["mode", "rate", "prefix hit", *roles, "migrations", "retries"], rows, out)
    spec = [r for r in with_stats if r.get("speculative")]
    if spec:
        print("\n== Speculative decoding (over each run) ==", file=out)
        _table(
            ["mode", "rate", "verifications", "proposed", "accepted", "acceptance", "tokens/verification"],
            [
                [
                    r["mode"],
                    _rate(r),
                    f"{s['drafts']:.0f}",
                    f"{s['draft_tokens']:.0f}",
                    f"{s['accepted_tokens']:.0f}",
                    _pct(s["acceptance_rate"]),
                    "-" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}",
                ]
                for r in spec
                for s in [r["speculative"]]
            ],
            out,
        )
