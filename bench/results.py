"""Result files and console tables.

A result is a flat dict that uses the key names of ``vllm bench serve`` result files (with
``--save-detailed``) wherever the metric exists there, so tools written for those files read
these; the few additions (mode, workload, seed, goodput_slos_ms, p90_*) are new keys. Latency
statistics are in ms; the per-request ``ttfts`` and ``itls`` are in seconds, as in vLLM.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

from pdserve.bench.metrics import Goodput, RunMetrics, Timeline

LATENCY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


@dataclass(frozen=True, slots=True)
class RunInfo:
    mode: str  # 1p1d, colocated, live, hf
    backend: str  # pdserve-grpc or hf-generate
    model_id: str
    workload: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int
    goodput: Goodput


def to_result(info: RunInfo, m: RunMetrics, timelines: list[Timeline]) -> dict:
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
    }
    for key, _ in LATENCY_METRICS:
        for stat, value in asdict(getattr(m, key)).items():
            result[f"{stat}_{key}_ms"] = value  # mean_ttft_ms, median_ttft_ms, std_, p90_, p99_
    return result


def file_name(info: RunInfo) -> str:
    rate = "inf" if math.isinf(info.request_rate) else f"{info.request_rate:g}"
    conc = f"-concurrency{info.max_concurrency}" if info.max_concurrency else ""
    return f"{info.mode}-{rate}qps{conc}.json"


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


def print_tables(results: list[dict], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up per call, so redirected stdout (tests, callers) is honoured
    if not results:
        return
    print("\n== Throughput ==", file=out)
    rows = []
    for r in results:
        good = "-" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        rows.append([
            r["mode"], _rate(r), str(r["completed"]), str(r["failed"]), f"{r['duration']:.2f}",
            str(r["total_input_tokens"]), str(r["total_output_tokens"]),
            f"{r['request_throughput']:.2f}", good, f"{r['output_throughput']:.1f}", f"{r['total_token_throughput']:.1f}",
        ])
    _table(["mode", "rate", "ok", "failed", "time s", "in tok", "out tok", "req/s", "goodput", "out tok/s", "tot tok/s"], rows, out)
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
