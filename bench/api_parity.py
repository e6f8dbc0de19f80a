"""API parity benchmarks: what n > 1, structured output and logprobs cost, and
whether the OpenAI API's numbers are the engine's.

    python bench/api_parity.py choices      # n = 4 vs n = 1: wall time, same prompt and output length
    python bench/api_parity.py structured   # per output token at batch 8: JSON-schema-constrained vs free
    python bench/api_parity.py perplexity   # a fixed text's perplexity: OpenAI API (echo + logprobs) vs the engine

``choices`` and ``structured`` run the engine in this process and alternate the two cases in
rounds, so a ratio compares runs taken side by side (the machine is shared and noisy).
``perplexity`` starts a real stack (``pdserve up --colocated`` or 1P1D) and reads the text
back through the ``openai`` SDK, then scores the same tokens with the engine in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time

from pdserve.bench.engine_bench import make_engine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import Constraint

# An array of 200+ integers never closes within max_tokens: every constrained request generates
# exactly max_tokens, as the free ones do (ignore_eos), so both cases emit the same tokens count.
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}


def _drain(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[float, int]:
    started = time.perf_counter()
    for rid, ids, sp in requests:
        engine.add_request(rid, ids, sp)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - started, tokens


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def choices(args) -> dict:
    engine = make_engine(args.dtype, args.threads)
    prompt = _prompt(args.prompt_tokens, 1)
    rows: dict[int, list[float]] = {1: [], 4: []}
    _drain(engine, [("warm", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=0, n=4, ignore_eos=True))])
    for r in range(args.rounds):
        for n in (1, 4):
            sp = SamplingParams(max_tokens=args.output_tokens, temperature=1.0, seed=r, n=n, ignore_eos=True)
            wall, tokens = _drain(engine, [(f"n{n}-{r}", prompt, sp)])
            assert tokens == n * args.output_tokens
            rows[n].append(wall)
    ratios = [b / a for a, b in zip(rows[1], rows[4])]
    return {
        "bench": "choices",
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "n1_s": [round(x, 3) for x in rows[1]],
        "n4_s": [round(x, 3) for x in rows[4]],
        "n4_vs_n1": round(statistics.median(ratios), 3),
        "target": "<= 1.6",
        "forks": engine.choices.num_forks,
    }


def structured(args) -> dict:
    engine = make_engine(args.dtype, args.threads)
    prompts = [_prompt(args.prompt_tokens, 10 + i) for i in range(args.batch)]
    constraint = Constraint("json_schema", json.dumps(LONG_SCHEMA))
    engine.compile_constraint(SamplingParams(constraint=constraint))  # compiled once, before timing (as a worker does)
    per_token: dict[str, list[float]] = {"free": [], "json_schema": []}
    for r in range(args.rounds):
        for case in ("free", "json_schema"):
            sp = (
                SamplingParams(max_tokens=args.output_tokens, temperature=1.0, seed=r, ignore_eos=True)
                if case == "free"
                else SamplingParams(max_tokens=args.output_tokens, temperature=1.0, seed=r, constraint=constraint)
            )
            wall, tokens = _drain(engine, [(f"{case}-{r}-{i}", p, sp) for i, p in enumerate(prompts)])
            assert tokens == args.batch * args.output_tokens, f"{case}: {tokens} tokens"
            per_token[case].append(wall / tokens * 1e3)
    ratios = [b / a for a, b in zip(per_token["free"], per_token["json_schema"])]
    return {
        "bench": "structured",
        "dtype": args.dtype,
        "batch": args.batch,
        "output_tokens": args.output_tokens,
        "free_ms_per_token": [round(x, 2) for x in per_token["free"]],
        "json_schema_ms_per_token": [round(x, 2) for x in per_token["json_schema"]],
        "overhead": round(statistics.median(ratios) - 1, 4),
        "target": "<= 0.10",
    }


def perplexity(args) -> dict:
    import openai
    from transformers import AutoTokenizer

    from pdserve.bench.quality import fixed_text
    from pdserve.bench.quality import perplexity as engine_perplexity
    from pdserve.engine.model_store import resolve_model

    sys.path.insert(0, "tests")
    from processes import Stack

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    ids = tokenizer(fixed_text()).input_ids[: args.text_tokens]
    stack = Stack.up(
        *(("--colocated",) if args.mode == "colocated" else ("--prefill", "1", "--decode", "1")),
        "--dtype",
        args.dtype,
        "--kv-cache-memory",
        "512MiB",
        "--http-port",
        "0",
    )
    try:
        http = next(p["http"] for p in stack.processes if p["role"] == "router")
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        total, count, started = 0.0, 0, time.perf_counter()
        for start in range(0, len(ids) - 1, args.window):  # the windows quality.perplexity scores
            window = ids[start : start + args.window]
            if len(window) < 2:
                break
            out = client.completions.create(
                model=model, prompt=window, max_tokens=1, temperature=0, echo=True, logprobs=0
            )
            logprobs = out.choices[0].logprobs.token_logprobs[1 : len(window)]
            total -= sum(logprobs)
            count += len(logprobs)
        api_s = time.perf_counter() - started
    finally:
        stack.down()
    engine = make_engine(args.dtype, args.threads, kv_cache_memory="512MiB")
    own = engine_perplexity(engine, ids, window=args.window)
    api_ppl = math.exp(total / count)
    return {
        "bench": "perplexity",
        "mode": args.mode,
        "dtype": args.dtype,
        "text": "pydoc_data.topics",
        "tokens": count,
        "api_perplexity": round(api_ppl, 5),
        "engine_perplexity": round(own.ppl, 5),
        "relative_difference": f"{abs(api_ppl / own.ppl - 1):.2e}",
        "api_seconds": round(api_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=("choices", "structured", "perplexity"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--text-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--mode", choices=("1p1d", "colocated"), default="1p1d")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = {"choices": choices, "structured": structured, "perplexity": perplexity}[args.bench](args)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
