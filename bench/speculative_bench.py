"""Speculative decoding, side by side in one process: engines without speculation, with n-gram
lookup and with draft models, on the same requests (no servers: the engine's own steps).

    python bench/speculative_bench.py --json spec.json                  # everything below
    python bench/speculative_bench.py --parts batch1 --workloads extractive --num-prompts 6
    python bench/speculative_bench.py --threads 1 ...                   # on a machine shared with others

On a machine whose cores are busy with other work, use one thread: with two, the same engine's
step times moved tenfold between runs here (threads waiting for each other at every op).

Parts:
- ``batch1``: one request at a time; each request runs on every engine back to back (the
  order rotates), so the machine's drift hits all of them alike. ITL per token: each step's
  time split over the tokens it emitted (what a client sees of a multi-token message, as
  SGLang's benchmark counts it); tokens per target forward: decode tokens / decode steps.
- ``rate``: Poisson arrivals at ``--rate`` req/s into each engine in turn (two rounds, the
  order reversed in the second), throughput = output tokens / time from the first arrival to
  the last token.

Engines: ``none``, ``ngram``, ``draft-self`` (the default model as its own draft: every
greedy proposal is kept, so it measures the bookkeeping, not a speed-up) and
``draft-L<n>`` (the default model cut to its first n layers: a real, weaker draft).
Workloads: ``bench/workloads.py``'s extractive, random and sharegpt (greedy, EOS ignored).
Targets: extractive batch 1 ngram ITL p50 <= 0.6x none; draft-self tokens per
forward >= 0.9 (K + 1); random throughput >= 0.95x none.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

from pdserve.bench import workloads  # noqa: E402
from pdserve.engine.engine_config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_store import resolve_model, write_first_layers  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

TARGETS = {"extractive_itl_ratio": 0.6, "self_draft_tokens_per_forward": 0.9, "random_throughput_ratio": 0.95}


@dataclass
class Tally:
    """One engine's figures over a part of the benchmark."""

    itl_per_token: list[float] = field(default_factory=list)  # seconds
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_time: float = 0.0
    output_tokens: int = 0
    elapsed: float = 0.0

    def summary(self, spec: dict | None) -> dict:
        return {
            "itl_per_token_p50_ms": 1e3 * statistics.median(self.itl_per_token) if self.itl_per_token else None,
            "itl_per_token_mean_ms": 1e3 * statistics.fmean(self.itl_per_token) if self.itl_per_token else None,
            "decode_tokens_per_s": self.decode_tokens / self.decode_time if self.decode_time else None,
            "tokens_per_forward": self.decode_tokens / self.decode_steps if self.decode_steps else None,
            "output_throughput": self.output_tokens / self.elapsed if self.elapsed else None,
            **(spec or {}),
        }


def truncated_copy(layers: int, cache: Path) -> Path:
    """The default model cut to its first ``layers`` layers (a draft), built once under ``cache``."""
    source = resolve_model(None)
    folder = cache / f"{source.name}-first-{layers}-layers"
    if (folder / "model.safetensors").is_file():
        return folder
    return write_first_layers(source, layers, folder)


def make_engines(args: argparse.Namespace) -> dict[str, LLMEngine]:
    # No prefix caching: every engine computes every prompt (the rounds repeat prompts).
    base = dict(
        dtype=args.dtype,
        device="cpu",
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        enable_prefix_caching=False,
        num_speculative_tokens=args.k,
    )
    engines = {"none": LLMEngine(EngineConfig(**base))}
    engines["ngram"] = LLMEngine(EngineConfig(**base, speculative="ngram"))
    model = str(resolve_model(None))
    if args.self_draft:
        engines["draft-self"] = LLMEngine(EngineConfig(**base, speculative="draft", draft_model=model))
    for layers in args.draft_layers:
        draft = truncated_copy(layers, Path(args.cache))
        engines[f"draft-L{layers}"] = LLMEngine(EngineConfig(**base, speculative="draft", draft_model=str(draft)))
    return engines


def spec_delta(engine: LLMEngine, before) -> dict | None:
    after = engine.speculator.stats if engine.speculator else None
    if after is None:
        return None
    drafts = after.drafts - before.drafts
    proposed = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    return {
        "verifications": drafts,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def run_alone(engine: LLMEngine, spec: workloads.RequestSpec, tally: Tally) -> None:
    engine.add_request(
        "r", list(spec.prompt_token_ids), SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True)
    )
    first = True
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - start
        n = sum(len(o.new_token_ids) for o in outputs)
        if first:  # the prompt's step (TTFT), not decode
            first = not n
            continue
        tally.decode_time += dt
        tally.decode_steps += 1
        tally.decode_tokens += n
        tally.itl_per_token += [dt / n] * n if n else []


def batch1(engines: dict[str, LLMEngine], specs: list[workloads.RequestSpec]) -> dict[str, dict]:
    tallies = {name: Tally() for name in engines}
    before = {name: e.speculator.stats if e.speculator else None for name, e in engines.items()}
    names = list(engines)
    for i, spec in enumerate(specs):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            run_alone(engines[name], spec, tallies[name])
    return {name: tallies[name].summary(spec_delta(engines[name], before[name])) for name in engines}


def at_rate(engine: LLMEngine, specs: list[workloads.RequestSpec], rate: float, seed: int, tally: Tally) -> None:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(specs))
    arrivals = np.cumsum(gaps) - gaps[0]
    start = time.perf_counter()
    last: dict[str, float] = {}
    pending = 0
    while pending < len(specs) or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending < len(specs) and arrivals[pending] <= now:
            s = specs[pending]
            engine.add_request(
                f"q{pending}",
                list(s.prompt_token_ids),
                SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True),
            )
            pending += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.05, arrivals[pending] - now)))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        for o in outputs:
            n = len(o.new_token_ids)
            tally.output_tokens += n
            if o.request_id in last and n:
                tally.itl_per_token += [(t - last[o.request_id]) / n] * n
            if n:
                last[o.request_id] = t
    tally.elapsed += time.perf_counter() - start


def rate_part(
    engines: dict[str, LLMEngine], specs: list[workloads.RequestSpec], rate: float, seed: int
) -> dict[str, dict]:
    tallies = {name: Tally() for name in engines}
    before = {name: e.speculator.stats if e.speculator else None for name, e in engines.items()}
    for names in (list(engines), list(reversed(engines))):
        for name in names:
            at_rate(engines[name], specs, rate, seed, tallies[name])
    return {name: tallies[name].summary(spec_delta(engines[name], before[name])) for name in engines}


def ratios(results: dict[str, dict], key: str) -> dict[str, float | None]:
    base = results["none"][key]
    return {name: (r[key] / base if r[key] and base else None) for name, r in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="batch1,rate", help="batch1, rate (default: both)")
    p.add_argument("--workloads", default="extractive,random,sharegpt")
    p.add_argument("--num-prompts", type=int, default=6, help="requests per workload and part (default: 6)")
    p.add_argument("--output-len", default="64", help="output tokens, N or LO:HI (default: 64)")
    p.add_argument("--random-input-len", default="64:256", help="random/sharegpt input tokens (default: 64:256)")
    p.add_argument("--rate", type=float, default=1.0, help="req/s of the rate part (default: 1)")
    p.add_argument("--rate-prompts", type=int, default=12, help="requests per workload in the rate part (default: 12)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    p.add_argument("--draft-layers", default="6", help="truncated drafts, comma-separated layer counts (default: 6)")
    p.add_argument(
        "--no-self-draft", dest="self_draft", action="store_false", help="skip the default model as its own draft"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "pdserve-spec-bench"),
        help="where truncated drafts are built",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    try:  # everything a typo can break, before any model loads
        args.draft_layers = [int(x) for x in args.draft_layers.split(",") if x]
        if any(n < 1 for n in args.draft_layers) or args.k < 1:
            raise ValueError("--k and --draft-layers must be >= 1")
        if not set(args.parts.split(",")) <= {"batch1", "rate"}:
            raise ValueError(f"--parts takes batch1 and/or rate, got {args.parts!r}")
        if not set(args.workloads.split(",")) <= {"extractive", "random", "sharegpt"}:
            raise ValueError(f"--workloads takes extractive, random and/or sharegpt, got {args.workloads!r}")
        workloads.parse_range(args.output_len), workloads.parse_range(args.random_input_len)
    except ValueError as e:
        p.error(str(e))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    engines = make_engines(args)
    warm = workloads.RequestSpec(tuple(tokenizer.encode("Warm up: the quick brown fox jumps over the lazy dog.")), 8)
    for engine in engines.values():  # every engine's first steps (kernel builds, caches), untimed
        run_alone(engine, warm, Tally())
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "targets": TARGETS}
    for part in args.parts.split(","):
        out[part] = {}
        for name in args.workloads.split(","):
            n = args.num_prompts if part == "batch1" else args.rate_prompts
            wl = workloads.WorkloadConfig(
                name=name,
                num_prompts=n,
                seed=args.seed,
                output_len=workloads.parse_range(args.output_len),
                input_len=None if name == "extractive" else workloads.parse_range(args.random_input_len),
            )
            specs = workloads.build(wl, lambda: tokenizer)
            results = batch1(engines, specs) if part == "batch1" else rate_part(engines, specs, args.rate, args.seed)
            out[part][name] = {
                "engines": results,
                "itl_ratio": ratios(results, "itl_per_token_p50_ms"),
                "throughput_ratio": ratios(results, "decode_tokens_per_s" if part == "batch1" else "output_throughput"),
            }
            print(json.dumps({part: {name: out[part][name]}}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
