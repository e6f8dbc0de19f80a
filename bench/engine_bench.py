"""Engine benchmarks (no servers): throughput vs Hugging Face, step overhead, roofline.

    python bench/engine_bench.py throughput --dtype bfloat16     # 64 requests vs HF static batches of 8
    python bench/engine_bench.py overhead --dtype bfloat16       # decode step vs bare forward
    python bench/engine_bench.py roofline --dtype bfloat16       # batch-1 decode and prefill vs machine limits
    python bench/engine_bench.py roofline --compile              # ... and batch-1 decode under torch.compile

Every figure of one invocation is measured in the same process, side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def make_jobs(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job([rng.randrange(1000, 40000) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def make_engine(dtype: str, threads: int, **overrides) -> LLMEngine:
    settings = dict(dtype=dtype, device="cpu", kv_cache_memory="4GiB", num_threads=threads, max_num_seqs=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(resolve_model(None)))


def run_engine(engine: LLMEngine, jobs: list[Job]) -> tuple[float, int]:
    for i, job in enumerate(jobs):
        engine.add_request(f"r{i}", job.prompt, SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True))
    produced = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - started, produced


def run_hf(jobs: list[Job], dtype: torch.dtype, batch_size: int = 8) -> tuple[float, int]:
    """transformers generate, static batches in arrival order, left padding; counts only requested tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=dtype).eval()
    pad = 0
    started = time.perf_counter()
    useful = 0
    for b in range(0, len(jobs), batch_size):
        batch = jobs[b : b + batch_size]
        width = max(len(j.prompt) for j in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt)) + j.prompt for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(j.max_tokens for j in batch),
                           do_sample=False, eos_token_id=None, pad_token_id=pad)
        useful += sum(j.max_tokens for j in batch)
    return time.perf_counter() - started, useful


def throughput(args: argparse.Namespace) -> dict:
    jobs = make_jobs(args.num_requests, (32, 512), (32, 256), args.seed)
    engine = make_engine(args.dtype, args.threads)
    run_engine(engine, make_jobs(4, (16, 32), (4, 8), args.seed + 1))  # warm-up
    engine_s, engine_tokens = run_engine(engine, jobs)
    torch.set_num_threads(args.threads)
    hf_s, hf_tokens = run_hf(jobs, engine.dtype)
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    return {
        "bench": "throughput", "dtype": args.dtype, "requests": len(jobs), "output_tokens": engine_tokens,
        "engine_s": round(engine_s, 2), "engine_tok_s": round(engine_tps, 1),
        "hf_s": round(hf_s, 2), "hf_tok_s": round(hf_tps, 1), "speedup": round(engine_tps / hf_tps, 2),
    }


def overhead(args: argparse.Namespace) -> dict:
    """Median decode-step time vs the bare model forward on the same batch."""
    engine = make_engine(args.dtype, args.threads)
    rows = {}
    for batch in (1, 8, 32):
        for i, job in enumerate(make_jobs(batch, (128, 128), (200, 200), args.seed)):
            engine.add_request(f"o{batch}-{i}", job.prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
            engine.step()
        steps = [_timed(engine.step) for _ in range(args.repeats)]
        forward_batch = engine.runner.build_batch(engine.scheduler.schedule())
        forwards = [_timed(lambda: engine.model(forward_batch, engine.kv_cache.layers)) for _ in range(args.repeats)]
        for rid in list(engine.requests):
            engine.abort(rid)
        rows[batch] = {
            "step_ms": round(statistics.median(steps) * 1e3, 2),
            "forward_ms": round(statistics.median(forwards) * 1e3, 2),
            "ratio": round(statistics.median(steps) / statistics.median(forwards), 3),
        }
    return {"bench": "overhead", "dtype": args.dtype, "by_batch": rows}


def roofline(args: argparse.Namespace) -> dict:
    engine = make_engine(args.dtype, args.threads)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    bandwidth = _memory_bandwidth()
    peak = _matmul_peak(engine.dtype)
    decode_s = _batch1_decode_s(engine, args.repeats)
    # Prefill: one 512-token prompt per step.
    prompt_s = []
    for i in range(max(3, args.repeats // 5)):
        engine.add_request(f"p{i}", [1000 + (i * 7 + j) % 30000 for j in range(512)], SamplingParams(max_tokens=1, temperature=0))
        prompt_s.append(_timed(engine.step))
    compiled = {}
    if args.compile:
        # Python dispatch between the small ops is what torch.compile could remove: fuse each
        # layer's norms and MLP with inductor (attention stays the paged kernel).
        started = time.perf_counter()
        for layer in engine.model.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                setattr(layer, name, torch.compile(getattr(layer, name), dynamic=True))
        _batch1_decode_s(engine, 1)  # compiles
        compiled = {"compile_s": round(time.perf_counter() - started, 1),
                    "decode_ms_compiled": round(_batch1_decode_s(engine, args.repeats) * 1e3, 2)}
    flops_per_token = 2 * (weight_bytes / engine.dtype.itemsize)
    floor_s = weight_bytes / bandwidth
    prefill_tps = 512 / statistics.median(prompt_s)
    return {
        "bench": "roofline", "dtype": args.dtype, "weight_mb": round(weight_bytes / 1e6, 1),
        "memory_gb_s": round(bandwidth / 1e9, 1), "matmul_gflop_s": round(peak / 1e9, 1),
        "decode_ms": round(decode_s * 1e3, 2), "decode_floor_ms": round(floor_s * 1e3, 2),
        "decode_fraction_of_limit": round(floor_s / decode_s, 3),
        "prefill_tok_s": round(prefill_tps, 1), "prefill_limit_tok_s": round(peak / flops_per_token, 1),
        "prefill_fraction_of_peak": round(prefill_tps * flops_per_token / peak, 3), **compiled,
    }


def _batch1_decode_s(engine: LLMEngine, repeats: int) -> float:
    """Median step time of one sequence decoding at a short context."""
    engine.add_request("b1", list(range(1000, 1064)), SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    decode_s = statistics.median(_timed(engine.step) for _ in range(repeats))
    engine.abort("b1")
    return decode_s


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _memory_bandwidth() -> float:
    """Read bandwidth: summing a buffer far larger than the caches."""
    x = torch.ones(256 * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _matmul_peak(dtype: torch.dtype) -> float:
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=("throughput", "overhead", "roofline"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="roofline: also batch-1 decode with torch.compile (inductor)")
    args = parser.parse_args(argv)
    result = {"throughput": throughput, "overhead": overhead, "roofline": roofline}[args.bench](args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
