"""One OpenAI streaming client against ``pdserve up --http-port`` and llama.cpp's OpenAI server.

What a user compares before picking a CPU server: the same client, the same GGUF, the same
prompts, each server in turn on the whole machine. llama.cpp serves the wheel's GGUF through
``python -m llama_cpp.server`` (``pip install 'pdserve[bench]'``, built from source with
``CMAKE_ARGS=-DGGML_NATIVE=ON``) on every core; pdserve runs ``pdserve up`` with its defaults
plus the flags of each ``--pdserve`` entry. Rounds alternate the servers, each started fresh,
so machine load hits them alike. Every request asks for exactly ``--output-len`` tokens (no EOS:
pdserve's ``ignore_eos``, llama.cpp's logit bias on the end tokens, which is what its server
offers) and is checked to have streamed them.

    python bench/http_vs_llamacpp.py --rounds 2 --num-prompts 8 --concurrency 1,8 \
        --pdserve= --pdserve="--quantization int4" --pdserve="--colocated --quantization int4"

(each ``--pdserve=FLAGS`` is one pdserve configuration; write it with ``=``, since its flags
start with dashes; an empty one is ``pdserve up``'s defaults). Requests are greedy unless
``--temperature``/``--top-p`` say otherwise; sampled, llama.cpp's own extra samplers are turned
off so that both servers draw from the same distribution.

Reported per server and concurrency, with the serving benchmark's definitions (bench/metrics.py,
vLLM's): TTFT, TPOT ((last token - first token) / (tokens - 1) per request) and ITL (every gap
between streamed tokens), in ms, plus output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.metrics import Timeline, compute
from pdserve.process import free_port

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): banned so every answer has the same length.
END_TOKEN_IDS = (0, 2)


@dataclass(frozen=True, slots=True)
class Server:
    label: str
    kind: str  # "llama.cpp" or "pdserve"
    flags: tuple[str, ...] = ()

    def command(self, port: int, threads: int) -> list[str]:
        if self.kind == "llama.cpp":
            from pdserve.engine.model_store import DEFAULT_MODEL

            return [
                sys.executable, "-m", "llama_cpp.server",
                "--model", str(DEFAULT_MODEL.locate()),
                "--n_threads", str(threads), "--n_threads_batch", str(threads),
                "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port),
                # queue concurrent requests (its default cuts the running stream short instead)
                "--interrupt_requests", "False",
            ]  # fmt: skip
        # gRPC on a port of the router's choosing: not the default 50051, which a running stack may hold
        return [sys.executable, "-m", "pdserve.cli", "up", "--host", "127.0.0.1", "--port", "0",
                "--http-port", str(port), *self.flags]  # fmt: skip

    def extra_body(self, sampled: bool = False) -> dict:
        """Exact lengths, each server its own way; ``sampled``: llama.cpp's own default samplers
        (top_k 40, min_p 0.05, repeat_penalty 1.1) off, so both servers draw from the same
        distribution, the one temperature and top_p give."""
        if self.kind == "llama.cpp":
            neutral = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0} if sampled else {}
            return {"logit_bias": {str(t): -100.0 for t in END_TOKEN_IDS}, **neutral}
        return {"ignore_eos": True}


def parse_servers(pdserve_flags: list[str]) -> list[Server]:
    servers = [Server("llama.cpp", "llama.cpp")]
    for flags in pdserve_flags or [""]:
        split = tuple(flags.split())
        servers.append(Server("pdserve" + (f" {flags.strip()}" if split else ""), "pdserve", split))
    return servers


def _wait_up(process: subprocess.Popen, base: str) -> str:
    """The served model's id, once the server answers; raises if it exits or never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as response:
                return json.load(response)["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no answer from {base} within {START_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.model_store import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


def count_tokens(text: str) -> int:
    """Tokens of an answer's text, for a server that reports no usage (vLLM's benchmark does the same)."""
    return len(_tokenizer().encode(text, add_special_tokens=False))


def prompts(count: int, length: int) -> list[str]:
    """``count`` distinct texts of ``length`` tokens (the model's tokenizer), cut from the fixed
    quality text, so no server reuses a cached prefix between requests."""
    from pdserve.bench.quality import fixed_text

    tokenizer = _tokenizer()
    ids = tokenizer(fixed_text()).input_ids
    if len(ids) < (count + 1) * length:
        raise ValueError(f"{count} prompts of {length} tokens are more than the fixed text's {len(ids)} tokens")
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(1, count + 1)]


async def _one(
    client,
    model: str,
    prompt: str,
    output_len: int,
    extra: dict,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tokens_of: Callable[[str], int] | None = None,
) -> Timeline:
    """One streamed request; an error, or an answer not exactly ``output_len`` tokens long, marks it failed.
    Its length is the server's usage count, else ``tokens_of`` its text, else its chunks with text."""
    timeline = Timeline(prompt_len=0, max_tokens=output_len, send_time=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=output_len,
            temperature=temperature,
            top_p=top_p,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        reported, texts = None, []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:  # a server streams one token per chunk
                timeline.chunk_times.append(time.perf_counter())
                timeline.chunk_tokens.append(1)
                texts.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None) is not None:
                reported = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - recorded as a failed request, never dropped
        timeline.error = f"{type(e).__name__}: {e}"
        return timeline
    if reported is None and tokens_of is not None:  # llama-cpp-python's server ignores include_usage
        reported = tokens_of("".join(texts))
    if reported is not None and timeline.chunk_tokens and reported > timeline.output_tokens:
        # A token with no text of its own (half of a multi-byte character) streams no chunk, or
        # shares one; the count is the truth. Its text came in a later chunk: count it with the last.
        timeline.chunk_tokens[-1] += reported - timeline.output_tokens
    if timeline.chunk_times:
        timeline.end_time = timeline.chunk_times[-1]  # TPOT runs from the first token to the last
    if timeline.output_tokens != output_len:
        timeline.error = f"asked for {output_len} tokens, {timeline.output_tokens} streamed"
    return timeline


async def run_load(
    base: str,
    model: str,
    texts: list[str],
    concurrency: int,
    output_len: int,
    extra: dict,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tokens_of: Callable[[str], int] | None = None,
) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    gate = asyncio.Semaphore(concurrency)

    async def limited(text: str) -> Timeline:
        async with gate:
            return await _one(client, model, text, output_len, extra, temperature, top_p, tokens_of)

    try:
        started = time.perf_counter()
        timelines = await asyncio.gather(*(limited(t) for t in texts))
        run = compute(timelines, time.perf_counter() - started)
    finally:
        await client.close()
    return {
        "concurrency": concurrency,
        "completed": run.completed,
        "failed": [t.error for t in timelines if t.error][:3],
        "output_tok_s": round(run.output_throughput, 1),
        "ttft_p50_ms": round(run.ttft.median, 2),
        "tpot_p50_ms": round(run.tpot.median, 2),
        "tpot_mean_ms": round(run.tpot.mean, 2),
        "itl_p50_ms": round(run.itl.median, 2),
        "itl_p99_ms": round(run.itl.p99, 2),
    }


def measure(server: Server, args, texts: list[str], warm: str) -> list[dict]:
    port = free_port()
    process = subprocess.Popen(
        server.command(port, args.threads),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        model = _wait_up(process, base)
        extra = server.extra_body(sampled=args.temperature > 0)
        request = (args.output_len, extra, args.temperature, args.top_p, count_tokens)
        warmed = asyncio.run(run_load(base, model, [warm], 1, *request))
        if warmed["failed"]:
            raise RuntimeError(f"the warm-up request failed: {warmed['failed'][0]}")
        return [
            {"server": server.label, **asyncio.run(run_load(base, model, texts, c, *request))} for c in args.concurrency
        ]
    finally:
        _stop(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated client concurrencies")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    parser.add_argument(
        "--pdserve",
        action="append",
        metavar="FLAGS",
        help="--pdserve='FLAGS': pdserve up's flags for one configuration (repeatable; default: its defaults)",
    )
    parser.add_argument("--json", help="also write every run here")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        args.concurrency = [0]
    for ok, message in (
        (min(args.concurrency) >= 1, "--concurrency takes comma-separated positive integers"),
        (args.rounds >= 1 and args.num_prompts >= 1, "--rounds and --num-prompts must be >= 1"),
        (args.input_len >= 1 and args.output_len >= 2, "--input-len must be >= 1 and --output-len >= 2"),
        (args.threads >= 1, "--threads must be >= 1"),
        (0 <= args.temperature <= 2 and 0 < args.top_p <= 1, "--temperature must be in [0, 2] and --top-p in (0, 1]"),
    ):
        if not ok:
            parser.error(message)
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        parser.exit(
            1, f"llama.cpp's server is not installed ({e}): CMAKE_ARGS=-DGGML_NATIVE=ON pip install 'pdserve[bench]'\n"
        )
    try:
        texts = prompts(args.num_prompts + 1, args.input_len)  # one more, to warm each server up
    except ValueError as e:
        parser.error(str(e))
    warm, texts = texts[0], texts[1:]
    runs, code = [], 0
    try:
        for round_ in range(args.rounds):
            for server in parse_servers(args.pdserve):
                for row in measure(server, args, texts, warm):
                    runs.append({"round": round_, **row})
                    print(json.dumps(runs[-1]), flush=True)
    except (RuntimeError, TimeoutError) as e:  # a server that did not start or serve: say which
        print(f"{server.label}: {e}", file=sys.stderr)
        code = 1
    if args.json:  # what was measured, even when a server failed
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
