"""Batch-1 decode and prefill against llama.cpp on the same GGUF and thread count, with quality.

llama.cpp runs through ``llama-cpp-python`` (an optional extra: ``pip install 'pdserve[bench]'``,
built from source with ``CMAKE_ARGS=-DGGML_NATIVE=ON``), never a server dependency. Each system
is measured in a fresh process of its own (two thread pools in one process keep stealing each
other's cores), in alternating rounds so machine load hits all alike, on the same token ids:
decode tokens/s after a short prompt, prefill tokens/s on a 512-token prompt. Perplexity of the
fixed text (bench/quality.py) is printed beside every speed figure, llama.cpp's included.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time

import numpy as np

PROMPT_TOKENS = 512
DECODE_CONTEXT = 64
DECODE_TOKENS = 64
SYSTEMS = ("llama.cpp", "none", "int8", "int4")  # pdserve's quantizations, by name
NOT_INSTALLED = "llama-cpp-python is not installed: CMAKE_ARGS=-DGGML_NATIVE=ON pip install 'pdserve[bench]'"


class LlamaCpp:
    def __init__(self, threads: int, logits_all: bool = False) -> None:
        from pdserve.engine.model_store import DEFAULT_MODEL

        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise SystemExit(f"{NOT_INSTALLED} ({e})") from None
        self.llm = Llama(
            model_path=str(DEFAULT_MODEL.locate()),
            n_ctx=2048,
            n_batch=PROMPT_TOKENS,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            verbose=False,
        )

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


def prompt_ids() -> list[int]:
    return [1000 + (7 * j) % 30000 for j in range(PROMPT_TOKENS)]


def text_ids(tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from pdserve.bench.quality import fixed_text
    from pdserve.engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None))).encode(fixed_text())[:tokens]


def measure(system: str, what: str, threads: int, repeats: int, tokens: int, dtype: str = "auto") -> dict:
    """One system's figures, in this (fresh) process."""
    prompt = prompt_ids()
    if system == "llama.cpp":
        if what == "perplexity":
            return {"perplexity": LlamaCpp(threads, logits_all=True).perplexity(text_ids(tokens))}
        llama = LlamaCpp(threads)
        llama.prefill_s(prompt[:32])  # warm-up
        return {
            "decode_s": llama.decode_s(prompt[:DECODE_CONTEXT], DECODE_TOKENS),
            "prefill_s": statistics.median(llama.prefill_s(prompt) for _ in range(repeats)),
        }
    from pdserve.bench.engine_bench import dtype_name, make_engine
    from pdserve.bench.quality import perplexity
    from pdserve.bench.roofline import batch1_decode_s, prefill_s

    engine = make_engine(dtype, threads, quantization=system, kv_cache_memory="512MiB")
    if what == "perplexity":
        return {"perplexity": perplexity(engine, text_ids(tokens)).ppl}
    prefill_s(engine, 1, 32)  # warm-up
    return {
        "dtype": dtype_name(engine),
        "decode_s": batch1_decode_s(engine, DECODE_TOKENS, context=DECODE_CONTEXT),
        "prefill_s": prefill_s(engine, repeats, PROMPT_TOKENS),
    }


def _in_subprocess(system: str, what: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.bench.vs_llamacpp",
        "--system",
        system,
        "--what",
        what,
        "--threads",
        str(args.threads),
        "--repeats",
        str(max(3, args.repeats // 5)),
        "--text-tokens",
        str(args.text_tokens),
        "--dtype",
        args.dtype,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # its own words (a missing llama-cpp-python, a failed load), not a traceback of ours
        raise SystemExit(f"{system} {what} run failed (exit {done.returncode}):\n{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(NOT_INSTALLED)
    rounds = max(3, args.repeats // 5)
    speed: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for _ in range(rounds):
        for system in SYSTEMS:
            speed[system].append(_in_subprocess(system, "speed", args))
    quality = {system: _in_subprocess(system, "perplexity", args)["perplexity"] for system in SYSTEMS}
    ref_d = statistics.median(r["decode_s"] for r in speed["llama.cpp"])
    ref_p = statistics.median(r["prefill_s"] for r in speed["llama.cpp"])
    rows = {}
    for system in SYSTEMS:
        d = statistics.median(r["decode_s"] for r in speed[system])
        p = statistics.median(r["prefill_s"] for r in speed[system])
        rows[system if system == "llama.cpp" else f"pdserve-{system}"] = {
            "decode_tok_s": round(1 / d, 1),
            "decode_vs_llamacpp": round(ref_d / d, 2),
            "prefill_tok_s": round(PROMPT_TOKENS / p, 1),
            "prefill_vs_llamacpp": round(ref_p / p, 2),
            "perplexity": round(quality[system], 3),
            **({"dtype": speed[system][0]["dtype"]} if system != "llama.cpp" else {}),
        }
    return {
        "bench": "llamacpp",
        "threads": args.threads,
        "rounds": rounds,
        "text_tokens": args.text_tokens,
        "systems": rows,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one system's figures (run by `engine_bench.py llamacpp`)")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--what", choices=("speed", "perplexity"), required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=20480)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    a = parser.parse_args()
    print(json.dumps(measure(a.system, a.what, a.threads, a.repeats, a.text_tokens, a.dtype)))
