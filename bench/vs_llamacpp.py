"""Batch-1 decode and prefill against llama.cpp on the same GGUF and thread count, with quality.

llama.cpp runs through ``llama-cpp-python`` (an optional extra: ``pip install 'pdserve[bench]'``,
built from source with ``CMAKE_ARGS=-DGGML_NATIVE=ON``), never a server dependency. Both run in
this process, in alternating rounds, on the same token ids: decode tokens/s after a short prompt
and prefill tokens/s on a 512-token prompt. Perplexity of the fixed text (bench/quality.py) is
printed beside every speed figure, llama.cpp's included.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from pdserve.bench.quality import fixed_text, perplexity
from pdserve.bench.roofline import batch1_decode_s, prefill_s
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model

PROMPT_TOKENS = 512
DECODE_CONTEXT = 64
DECODE_TOKENS = 64
CONFIGS = ("none", "int8", "int4")


class LlamaCpp:
    def __init__(self, threads: int, logits_all: bool = False) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise SystemExit(f"llama-cpp-python is not installed ({e}): CMAKE_ARGS=-DGGML_NATIVE=ON pip install 'pdserve[bench]'")
        self.llm = Llama(model_path=str(DEFAULT_MODEL.locate()), n_ctx=2048, n_batch=PROMPT_TOKENS, n_threads=threads,
                         n_threads_batch=threads, logits_all=logits_all, verbose=False)

    def prefill_s(self, tokens: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - started

    def decode_s(self, prompt: list[int], steps: int) -> float:
        """Median time per greedy token after ``prompt``."""
        self.llm.reset()
        self.llm.eval(prompt)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            self.llm.eval([token])
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def perplexity(self, token_ids: list[int], window: int = 1024) -> float:
        total, count = 0.0, 0
        for start in range(0, len(token_ids) - 1, window):
            chunk = token_ids[start : start + window]
            if len(chunk) < 2:
                break
            self.llm.reset()
            self.llm.eval(chunk)
            logits = np.asarray(self.llm.scores[: len(chunk) - 1], dtype=np.float64)
            logits -= logits.max(axis=1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            total -= logp[np.arange(len(chunk) - 1), chunk[1:]].sum()
            count += len(chunk) - 1
        return math.exp(total / count)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from pdserve.bench.engine_bench import make_engine

    llama = LlamaCpp(args.threads)
    engines = {q: make_engine("bfloat16", args.threads, quantization=q, kv_cache_memory="512MiB") for q in CONFIGS}
    prompt = [1000 + (7 * j) % 30000 for j in range(PROMPT_TOKENS)]
    decode: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for _ in range(max(3, args.repeats // 5)):  # rounds: every system measured in each, noise hits all alike
        decode.setdefault("llama.cpp", []).append(llama.decode_s(prompt[:DECODE_CONTEXT], DECODE_TOKENS))
        prefill.setdefault("llama.cpp", []).append(llama.prefill_s(prompt))
        for q, engine in engines.items():
            decode.setdefault(q, []).append(batch1_decode_s(engine, DECODE_TOKENS, context=DECODE_CONTEXT))
            prefill.setdefault(q, []).append(prefill_s(engine, 1, PROMPT_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    text_ids = tokenizer(fixed_text()).input_ids[: args.text_tokens]
    ppl = {q: perplexity(engine, text_ids).ppl for q, engine in engines.items()}
    del engines
    ppl["llama.cpp"] = LlamaCpp(args.threads, logits_all=True).perplexity(text_ids)
    rows = {}
    ref_decode, ref_prefill = statistics.median(decode["llama.cpp"]), statistics.median(prefill["llama.cpp"])
    for name in ("llama.cpp", *CONFIGS):
        d, p = statistics.median(decode[name]), statistics.median(prefill[name])
        rows[name if name == "llama.cpp" else f"pdserve-{name}"] = {
            "decode_tok_s": round(1 / d, 1), "decode_vs_llamacpp": round(ref_decode / d, 2),
            "prefill_tok_s": round(PROMPT_TOKENS / p, 1), "prefill_vs_llamacpp": round(ref_prefill / p, 2),
            "perplexity": round(ppl[name], 3),
        }
    return {"bench": "llamacpp", "threads": args.threads, "gguf": DEFAULT_MODEL.filename,
            "text_tokens": len(text_ids), "systems": rows}
