"""Engine benchmarks (no servers): throughput vs Hugging Face, step overhead, roofline, quality,
and batch-1 speed against llama.cpp on the same GGUF.

    python bench/engine_bench.py throughput --dtype bfloat16 --quantization int8  # 64 requests vs HF static batches of 8
    python bench/engine_bench.py overhead --dtype bfloat16       # decode step vs bare forward
    python bench/engine_bench.py sampling --dtype bfloat16       # decode step by sampling setting, and the sampler alone
    python bench/engine_bench.py roofline --quantization int4    # batch-1 decode and prefill vs machine limits
    python bench/engine_bench.py quality                         # perplexity and agreement: unquantized, int8, int4, 8-bit KV
    python bench/engine_bench.py llamacpp                        # batch-1 decode and prefill vs llama.cpp, with quality

Every figure of one invocation is measured in the same process, side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.engine.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
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
    # No prefix caching: a benchmark that repeats a prompt must compute it every time.
    settings = dict(
        dtype=dtype,
        device="cpu",
        kv_cache_memory="4GiB",
        num_threads=threads,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(resolve_model(None)))


def dtype_name(engine: LLMEngine) -> str:
    """The dtype an engine runs in (what ``--dtype auto`` resolved to)."""
    return str(engine.dtype).removeprefix("torch.")


def engine_from_args(args: argparse.Namespace, **overrides) -> LLMEngine:
    settings = dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    settings.update(overrides)
    return make_engine(args.dtype, args.threads, **settings)


def run_engine(engine: LLMEngine, jobs: list[Job]) -> tuple[float, int]:
    for i, job in enumerate(jobs):
        engine.add_request(
            f"r{i}", job.prompt, SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
        )
    produced = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - started, produced


def run_hf(
    jobs: list[Job], dtype: torch.dtype, batch_size: int = 8, warmup: list[Job] | None = None
) -> tuple[float, int]:
    """transformers generate, static batches in arrival order, left padding; counts only requested
    tokens. ``warmup`` runs first, untimed (the same warm-up the engine gets)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=dtype).eval()

    def generate(batch: list[Job]) -> None:
        width = max(len(j.prompt) for j in batch)
        ids = torch.tensor([[0] * (width - len(j.prompt)) + j.prompt for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in batch])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(j.max_tokens for j in batch),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    if warmup:
        generate(warmup)
    started = time.perf_counter()
    for b in range(0, len(jobs), batch_size):
        generate(jobs[b : b + batch_size])
    return time.perf_counter() - started, sum(j.max_tokens for j in jobs)


def throughput(args: argparse.Namespace) -> dict:
    jobs = make_jobs(args.num_requests, (32, 512), (32, 256), args.seed)
    warmup = make_jobs(4, (16, 32), (4, 8), args.seed + 1)
    engine = engine_from_args(args)
    run_engine(engine, warmup)
    engine_s, engine_tokens = run_engine(engine, jobs)
    torch.set_num_threads(args.threads)
    hf_s, hf_tokens = run_hf(jobs, engine.dtype, warmup=warmup)
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    return {
        "bench": "throughput",
        "dtype": dtype_name(engine),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "requests": len(jobs),
        "output_tokens": engine_tokens,
        "engine_s": round(engine_s, 2),
        "engine_tok_s": round(engine_tps, 1),
        "hf_s": round(hf_s, 2),
        "hf_tok_s": round(hf_tps, 1),
        "speedup": round(engine_tps / hf_tps, 2),
    }


def overhead(args: argparse.Namespace) -> dict:
    """Median decode-step time vs the bare model forward on the same batch."""
    engine = engine_from_args(args)
    rows = {}
    for batch in args.batch_sizes:
        for i, job in enumerate(make_jobs(batch, (128, 128), (200, 200), args.seed)):
            engine.add_request(
                f"o{batch}-{i}", job.prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            )
        while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
            engine.step()
        steps = [timed(engine.step) for _ in range(args.repeats)]
        forward_batch = engine.runner.build_batch(engine.scheduler.schedule())
        forwards = [
            timed(lambda batch=forward_batch: engine.model(batch, engine.kv_cache.layers)) for _ in range(args.repeats)
        ]
        for rid in list(engine.requests):
            engine.abort(rid)
        rows[batch] = {
            "step_ms": round(statistics.median(steps) * 1e3, 2),
            "forward_ms": round(statistics.median(forwards) * 1e3, 2),
            "ratio": round(statistics.median(steps) / statistics.median(forwards), 3),
        }
    return {"bench": "overhead", "dtype": dtype_name(engine), "quantization": args.quantization, "by_batch": rows}


# The settings users send most: greedy, the OpenAI default, a nucleus, a top-k, a seeded request.
SAMPLING_SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50": SamplingParams(top_k=50),
    "seeded": SamplingParams(temperature=1.0, seed=7),
}


def sampling(args: argparse.Namespace) -> dict:
    """The decode step under each sampling setting, and the sampler alone on that step's
    logits (one row of the vocabulary's 49k entries per sequence; leaving them as they are,
    where the step lets it work in their memory), by batch size."""
    engine = engine_from_args(args)
    sampler = engine.runner.sampler
    rows: dict = {}
    for batch in args.batch_sizes:
        jobs = make_jobs(batch, (128, 128), (args.repeats + 8, args.repeats + 8), args.seed)
        for name, params in SAMPLING_SETTINGS.items():
            settings = dataclasses.replace(params, max_tokens=args.repeats + 8, ignore_eos=True)
            for i, job in enumerate(jobs):
                engine.add_request(f"s{batch}-{name}-{i}", job.prompt, settings)
            while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
                engine.step()
            steps = [timed(engine.step) for _ in range(args.repeats)]
            logits = engine.model(engine.runner.build_batch(engine.scheduler.schedule()), engine.kv_cache.layers)
            for rid in list(engine.requests):
                engine.abort(rid)
            draw = functools.partial(sampler, logits, [settings] * batch, list(range(batch)))
            alone = [timed(draw) for _ in range(args.repeats)]
            rows.setdefault(batch, {})[name] = {
                "step_ms": round(statistics.median(steps) * 1e3, 2),
                "sampler_ms": round(statistics.median(alone) * 1e3, 3),
            }
    return {"bench": "sampling", "dtype": dtype_name(engine), "quantization": args.quantization, "by_batch": rows}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench import roofline, vs_llamacpp
    from pdserve.bench.quality import quality

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=("throughput", "overhead", "sampling", "roofline", "quality", "llamacpp"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: the engine's pick (bfloat16 where the CPU has bf16 instructions, else float32)",
    )
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: [int(b) for b in text.split(",")],
        default=[1, 8, 32],
        help="overhead, sampling: decode batch sizes, comma-separated",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text-tokens", type=int, default=20480, help="quality: tokens of the fixed text for perplexity"
    )
    parser.add_argument(
        "--compile", action="store_true", help="roofline: also batch-1 decode with torch.compile (inductor)"
    )
    args = parser.parse_args(argv)
    for name, low in (("threads", 1), ("num_requests", 1), ("repeats", 1), ("text_tokens", 2), ("seed", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes must be integers >= 1, got {args.batch_sizes}")
    benches = {
        "throughput": throughput,
        "overhead": overhead,
        "sampling": sampling,
        "roofline": roofline.run,
        "quality": quality,
        "llamacpp": vs_llamacpp.run,
    }
    print(json.dumps(benches[args.bench](args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
