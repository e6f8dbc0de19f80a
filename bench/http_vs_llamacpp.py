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
start with dashes; an empty one is ``pdserve up``'s defaults)

Reported per server and concurrency, as genai-bench and vLLM's benchmark define them: TTFT,
TPOT ((end - first token) / (tokens - 1) per request) and ITL (every gap between streamed
tokens), in ms, plus output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

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
        grpc_port = str(free_port())  # not the default 50051, which a running stack may hold
        return [sys.executable, "-m", "pdserve.cli", "up", "--host", "127.0.0.1", "--port", grpc_port,
                "--http-port", str(port), *self.flags]  # fmt: skip

    def extra_body(self) -> dict:
        if self.kind == "llama.cpp":
            return {"logit_bias": {str(t): -100.0 for t in END_TOKEN_IDS}}
        return {"ignore_eos": True}


def parse_servers(pdserve_flags: list[str]) -> list[Server]:
    servers = [Server("llama.cpp", "llama.cpp")]
    for flags in pdserve_flags or [""]:
        split = tuple(flags.split())
        servers.append(Server("pdserve" + (f" {flags.strip()}" if split else ""), "pdserve", split))
    return servers


@dataclass
class RequestTimes:
    sent: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each streamed token

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.sent

    @property
    def tpot(self) -> float:
        return (self.tokens[-1] - self.tokens[0]) / (len(self.tokens) - 1)


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


def prompts(count: int, length: int) -> list[str]:
    """``count`` distinct texts of ``length`` tokens (the model's tokenizer), cut from the fixed
    quality text, so no server reuses a cached prefix between requests."""
    from transformers import AutoTokenizer

    from pdserve.bench.quality import fixed_text
    from pdserve.engine.model_store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    ids = tokenizer(fixed_text()).input_ids
    if len(ids) < (count + 1) * length:
        raise ValueError(f"--num-prompts {count} x --input-len {length} is longer than the fixed text")
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(1, count + 1)]


async def _one(client, model: str, prompt: str, output_len: int, extra: dict) -> RequestTimes:
    times = RequestTimes(time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True, extra_body=extra
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.tokens.append(time.perf_counter())
    if len(times.tokens) != output_len:
        raise RuntimeError(f"asked for {output_len} tokens, {len(times.tokens)} streamed")
    return times


async def run_load(base: str, model: str, texts: list[str], concurrency: int, output_len: int, extra: dict) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    gate = asyncio.Semaphore(concurrency)

    async def limited(text: str) -> RequestTimes:
        async with gate:
            return await _one(client, model, text, output_len, extra)

    started = time.perf_counter()
    results = await asyncio.gather(*(limited(t) for t in texts), return_exceptions=True)
    duration = time.perf_counter() - started
    await client.close()
    done = [r for r in results if isinstance(r, RequestTimes)]
    failed = [repr(r) for r in results if not isinstance(r, RequestTimes)]
    itl = [b - a for r in done for a, b in zip(r.tokens, r.tokens[1:])]
    ms = lambda xs, q: round(1000 * statistics.quantiles(xs, n=100)[q - 1], 2) if len(xs) > 1 else None  # noqa: E731
    return {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": failed[:3],
        "output_tok_s": round(len(done) * output_len / duration, 1),
        "ttft_p50_ms": ms([r.ttft for r in done], 50),
        "tpot_p50_ms": ms([r.tpot for r in done], 50),
        "tpot_mean_ms": round(1000 * statistics.fmean(r.tpot for r in done), 2) if done else None,
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
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
        asyncio.run(run_load(base, model, [warm], 1, args.output_len, server.extra_body()))
        return [
            {
                "server": server.label,
                **asyncio.run(run_load(base, model, texts, c, args.output_len, server.extra_body())),
            }
            for c in args.concurrency
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
        if min(args.concurrency) < 1 or args.rounds < 1 or args.num_prompts < 1 or args.output_len < 2:
            raise ValueError
    except ValueError:
        parser.error("--concurrency takes positive integers; --rounds and --num-prompts >= 1; --output-len >= 2")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        parser.exit(
            1, f"llama.cpp's server is not installed ({e}): CMAKE_ARGS=-DGGML_NATIVE=ON pip install 'pdserve[bench]'\n"
        )
    texts = prompts(args.num_prompts + 1, args.input_len)
    warm, texts = texts[0], texts[1:]
    runs = []
    for round_ in range(args.rounds):
        for server in parse_servers(args.pdserve):
            for row in measure(server, args, texts, warm):
                runs.append({"round": round_, **row})
                print(json.dumps(runs[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
