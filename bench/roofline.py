"""How close batch-1 decode and prefill come to this machine's limits.

Decode is memory-bound: its floor is the bytes a step streams (every decoder linear layer's
weights as stored, quantized or not, and the lm_head; the embedding reads one row) over the
measured read bandwidth. Prefill is compute-bound: its FLOPs are counted honestly, the decoder
linears for every prompt token, causal attention, and the lm_head for the one token whose
logits are needed (a tied embedding's lookup is not a matmul), over the measured bf16/fp32
matmul peak.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.host_memory import host_zeros
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.packed_linear import PackedLinear, packable
from pdserve.engine.quantization import QuantizedLinear
from pdserve.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 512
ATTENTION_BATCH, ATTENTION_CONTEXT = 32, 400  # the batched decode shape the attention target is stated for
MIXED_LENS = [4000] + [100] * 31  # a long conversation batched with short ones


def streamed_bytes(layer: nn.Module) -> int:
    """Bytes of weights one forward through ``layer`` reads for a decode-sized input."""
    if isinstance(layer, QuantizedLinear):
        return layer.nbytes
    if isinstance(layer, PackedLinear):
        return layer.packed.numel() * layer.packed.element_size()
    return layer.weight.numel() * layer.weight.element_size()


def decoder_linears(engine: LLMEngine) -> list[nn.Module]:
    return [
        m
        for layer in engine.model.model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def prefill_flops(engine: LLMEngine, tokens: int) -> float:
    cfg = engine.model_config
    linear_params = sum(m.in_features * m.out_features for m in decoder_linears(engine))
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2 * cfg.num_layers  # QK^T and PV, causal
    head = 2 * cfg.hidden_size * cfg.vocab_size  # one row of logits
    return 2 * linear_params * tokens + attention + head


def batch1_decode_s(engine: LLMEngine, repeats: int, context: int = 64) -> float:
    """Median step time of one sequence decoding at a short context."""
    engine.add_request(
        "b1", list(range(1000, 1000 + context)), SamplingParams(max_tokens=repeats + 4, temperature=0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    decode_s = statistics.median(timed(engine.step) for _ in range(repeats))
    engine.abort("b1")
    return decode_s


def prefill_s(engine: LLMEngine, repeats: int, tokens: int = PROMPT_TOKENS) -> float:
    times = []
    for i in range(repeats):
        engine.add_request(
            f"p{i}", [1000 + (i * 7 + j) % 30000 for j in range(tokens)], SamplingParams(max_tokens=1, temperature=0)
        )
        times.append(timed(engine.step))
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


RESIDENT_BLOCKS = 64  # the cache-resident variant's distinct blocks (~0.8 MB of bf16 K/V)


@dataclass(frozen=True)
class AttentionInputs:
    """One decode step's attention inputs: a cache per layer, the queries, block tables and
    context lengths, and the K/V bytes the step reads."""

    caches: list[torch.Tensor]
    q: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    kv_bytes: int


def attention_inputs(
    engine: LLMEngine,
    batch: int = ATTENTION_BATCH,
    context: int = ATTENTION_CONTEXT,
    resident: bool = False,
    lens: list[int] | None = None,
) -> AttentionInputs:
    """``batch`` sequences of ``context`` tokens in shuffled blocks, as a long-running cache holds
    them. ``resident``: every table points into the same few blocks of one layer's cache, which
    stay in the CPU's caches: the kernel's compute alone, without the memory traffic. ``lens``:
    these context lengths instead (a mixed batch)."""
    layout, cfg = engine.kv_layout, engine.model_config
    lens = lens or [context] * batch
    batch = len(lens)
    seq_blocks = [-(-n // layout.block_size) for n in lens]
    max_blocks = max(seq_blocks)
    generator = torch.Generator().manual_seed(0)
    num_blocks = RESIDENT_BLOCKS if resident else sum(seq_blocks)
    if resident:
        block_tables = torch.randint(0, num_blocks, (batch, max_blocks), generator=generator, dtype=torch.int32)
    else:
        ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
        block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
        for row, (start, n) in enumerate(zip([0, *itertools.accumulate(seq_blocks)], seq_blocks)):
            block_tables[row, :n] = ids[start : start + n]
    context_lens = torch.tensor(lens, dtype=torch.int32)
    shape = (num_blocks, *engine.kv_cache.layers[0].shape[1:])
    distinct = 1 if resident else cfg.num_layers

    def random_layer() -> torch.Tensor:  # on the engine's pages (2 MB), one temporary at a time
        if layout.storage_dtype.is_floating_point:
            values = torch.randn(shape, generator=generator)
        else:  # 8-bit values with their scales packed in the slot: bytes that read as small, normal floats
            values = torch.randint(40, 60, shape, generator=generator, dtype=layout.storage_dtype)
        return host_zeros(shape, layout.storage_dtype).copy_(values)

    caches = [random_layer() for _ in range(distinct)]
    caches = caches * (cfg.num_layers // distinct)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=generator).to(engine.dtype)
    kv_bytes = sum(kv[0].numel() * kv.element_size() for kv in caches) * sum(lens) // layout.block_size
    return AttentionInputs(caches, q, block_tables, context_lens, kv_bytes)


def attention_step(engine: LLMEngine, inputs: AttentionInputs) -> Callable[[], None]:
    """One decode step's attention over every layer, by the engine's kernel."""
    backend, scale = engine.model.backend, engine.model_config.head_dim**-0.5

    def step() -> None:
        for kv in inputs.caches:
            backend.decode_attention(inputs.q, kv, inputs.block_tables, inputs.context_lens, scale)

    return step


def decode_attention_s(engine: LLMEngine, repeats: int, **shape) -> tuple[float, int]:
    """Median time of one decode step's attention over every layer (inputs as
    ``attention_inputs(engine, **shape)`` makes them), and the K/V bytes it reads."""
    inputs = attention_inputs(engine, **shape)
    step = attention_step(engine, inputs)
    step()
    seconds = statistics.median(timed(step) for _ in range(repeats))
    return seconds, inputs.kv_bytes


def run(args: argparse.Namespace) -> dict:
    from pdserve.bench.engine_bench import dtype_name, engine_from_args

    engine = engine_from_args(args)
    weight_bytes = sum(map(streamed_bytes, decoder_linears(engine))) + streamed_bytes(engine.model.lm_head)
    bandwidth = memory_bandwidth()
    peak = matmul_peak(engine.dtype, engine.model.backend.cpu_kernels if engine.device.type == "cpu" else None)
    decode = batch1_decode_s(engine, args.repeats)
    prefill = prefill_s(engine, max(3, args.repeats // 5))
    attention, attention_bytes = decode_attention_s(engine, max(5, args.repeats // 4))
    resident, _ = decode_attention_s(engine, max(5, args.repeats // 4), resident=True)
    mixed, mixed_bytes = decode_attention_s(engine, max(5, args.repeats // 4), lens=MIXED_LENS)
    compiled = {}
    if args.compile:
        # Python dispatch between the small ops is what torch.compile could remove: compile the
        # whole Python decoder (the C++ decode loop is switched off for this figure).
        engine.model.decode_stack = None
        started = time.perf_counter()
        engine.model.model.layers = nn.ModuleList(
            torch.compile(layer, dynamic=True) for layer in engine.model.model.layers
        )
        batch1_decode_s(engine, 1)  # compiles
        compiled = {
            "compile_s": round(time.perf_counter() - started, 1),
            "decode_ms_compiled": round(batch1_decode_s(engine, args.repeats) * 1e3, 2),
        }
    floor = weight_bytes / bandwidth
    flops = prefill_flops(engine, PROMPT_TOKENS)
    return {
        "bench": "roofline",
        "dtype": dtype_name(engine),
        "quantization": args.quantization,
        "threads": args.threads,
        "streamed_weight_mb": round(weight_bytes / 1e6, 1),
        "memory_gb_s": round(bandwidth / 1e9, 1),
        "matmul_gflop_s": round(peak / 1e9, 1),
        "decode_ms": round(decode * 1e3, 2),
        "decode_tok_s": round(1 / decode, 1),
        "decode_floor_ms": round(floor * 1e3, 2),
        "decode_fraction_of_limit": round(floor / decode, 3),
        "prefill_tok_s": round(PROMPT_TOKENS / prefill, 1),
        "prefill_gflop_per_prompt": round(flops / 1e9, 1),
        "prefill_fraction_of_peak": round(flops / prefill / peak, 3),
        "attention_shape": f"batch {ATTENTION_BATCH}, context {ATTENTION_CONTEXT}, {engine.model_config.num_layers} layers",
        "attention_ms": round(attention * 1e3, 2),
        "attention_kv_mb": round(attention_bytes / 1e6, 1),
        "attention_gb_s": round(attention_bytes / attention / 1e9, 1),
        "attention_fraction_of_bandwidth": round(attention_bytes / attention / bandwidth, 3),
        "attention_resident_ms": round(resident * 1e3, 2),  # the same step on cache-resident blocks
        "attention_mixed_shape": f"one context of {MIXED_LENS[0]}, {len(MIXED_LENS) - 1} of {MIXED_LENS[1]}",
        "attention_mixed_ms": round(mixed * 1e3, 2),
        "attention_mixed_gb_s": round(mixed_bytes / mixed / 1e9, 1),
        **compiled,
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_bandwidth() -> float:
    """Read bandwidth: summing a buffer far larger than the caches, on 2 MB pages as the engine's
    weights and KV cache are (on 4 KB pages the same sum measured 25-35 GB/s against 33-65)."""
    x = host_zeros((256 * 2**20 // 4,), torch.float32).fill_(1)
    x.sum()
    best = min(timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def matmul_peak(dtype: torch.dtype, kernels=None) -> float:
    """The faster of torch's matmul and the engine's packed kernel (``kernels``, where it has one
    for ``dtype``: torch's bf16 matmul on a CPU without bf16 instructions runs below 1 GFLOP/s,
    and the engine does not use it there), on a 2048 x 2048 weight."""
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = 2 * 2048**3 / min(timed(lambda: a @ b) for _ in range(5))
    if packable(kernels, dtype):
        layer, x = PackedLinear(nn.Linear(2048, 2048, bias=False, dtype=dtype), kernels), a[:512]
        layer(x)
        best = max(best, 2 * 512 * 2048**2 / min(timed(lambda: layer(x)) for _ in range(5)))
    return best
