"""Quantized weights (int8, int4, a GGUF's own blocks) and 8-bit KV caches in the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from pdserve.bench.quality import top1_agreement
from pdserve.engine import quantization
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_state_dict
from pdserve.engine.model_store import NATIVE_CODES
from pdserve.engine.quantization import QuantFormat, QuantizedLinear, load_codes
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(device="cpu", dtype="bfloat16", kv_cache_memory="64MiB", num_threads=2)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(model_dir))


def greedy(engine: LLMEngine, prompt_ids: list[int], n: int) -> list[int]:
    engine.add_request("g", prompt_ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


@pytest.fixture(scope="module")
def prompt_ids(hf_reference) -> list[list[int]]:
    return [hf_reference.tokenizer(p).input_ids for p in PROMPTS[:3]]


@pytest.fixture(scope="module")
def bf16_engine(model_dir) -> LLMEngine:
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def bf16_outputs(bf16_engine, prompt_ids) -> list[list[int]]:
    return [greedy(bf16_engine, ids, 16) for ids in prompt_ids]


def test_gguf_blocks_are_kept_exactly(model_dir):
    """The default model's Q4_1 linears and Q8_0 embedding are stored as they are in the GGUF:
    their dequantized values are exactly the converted fp32 weights."""
    native = load_codes(model_dir / NATIVE_CODES)
    state = load_state_dict(model_dir, torch.float32)
    assert native["model.layers.0.self_attn.q_proj.weight"].fmt is QuantFormat.INT4_GROUP
    assert native["model.embed_tokens.weight"].fmt is QuantFormat.INT8_GROUP
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        torch.testing.assert_close(native[name].dequantize(), state[name], atol=0, rtol=0)


# A bound well outside what this model measures (bench/RESULTS.md: 0.95-0.96 over 20k tokens)
# and well inside what a broken kernel gives (agreement near zero). Perplexity gates live in
# the benchmark (bench/engine_bench.py quality), which scores 20k+ tokens.
@pytest.mark.parametrize("mode, min_agreement", [("int8", 0.85), ("int4", 0.8)])
def test_quantized_engine_follows_bf16(model_dir, bf16_engine, prompt_ids, bf16_outputs, mode, min_agreement):
    engine = make_engine(model_dir, quantization=mode)
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * engine.model_config.num_layers + 1  # every linear layer and the lm_head
    assert all(layer.kernels is not None for layer in layers)  # the CPU kernel, not the fallback
    if mode == "int4":  # the GGUF's own Q4_1 blocks, its Q8_0 embedding as the lm_head
        assert engine.model.model.layers[0].self_attn.qkv_proj.fmt is QuantFormat.INT4_GROUP
        assert engine.model.lm_head.fmt is QuantFormat.INT8_GROUP
    else:
        assert engine.model.model.layers[0].mlp.down_proj.fmt is QuantFormat.INT8_CHANNEL
    outputs = [greedy(engine, ids, 8) for ids in prompt_ids]
    assert [o[0] for o in outputs] == [o[0] for o in bf16_outputs]  # the first token never flips here
    sequences = [ids + out for ids, out in zip(prompt_ids, bf16_outputs)]
    assert top1_agreement(engine, bf16_engine, sequences) >= min_agreement


def test_fallback_path_gives_the_kernels_tokens(model_dir, prompt_ids, monkeypatch):
    """Without the CPU kernel (as on CUDA) quantized layers dequantize and matmul: same weights,
    fp32 activations instead of int8 ones, so the same greedy text on these prompts."""
    kernel_tokens = greedy(make_engine(model_dir, quantization="int8", dtype="float32"), prompt_ids[0], 12)
    monkeypatch.setattr(quantization, "cpu_kernels", lambda: None)
    engine = make_engine(model_dir, quantization="int8", dtype="float32")
    assert all(m.kernels is None for m in engine.model.modules() if isinstance(m, QuantizedLinear))
    assert greedy(engine, prompt_ids[0], 12) == kernel_tokens


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_8bit_kv_cache_halves_memory_and_keeps_the_text(model_dir, prompt_ids, bf16_outputs, cache_dtype):
    engine = make_engine(model_dir, kv_cache_dtype=cache_dtype)
    plain = make_engine(model_dir)
    assert engine.kv_cache.tensor.dtype == torch.uint8
    # 64 values of K and V per head in one byte each plus their fp32 scales (padded to 16 bytes),
    # against two bytes each.
    assert engine.kv_layout.token_bytes / plain.kv_layout.token_bytes == pytest.approx(416 / 768)
    assert engine.kv_cache.num_blocks > 1.8 * plain.kv_cache.num_blocks
    outputs = [greedy(engine, ids, 16) for ids in prompt_ids]
    assert [o[0] for o in outputs] == [o[0] for o in bf16_outputs]
    assert top1_agreement(engine, plain, [ids + out for ids, out in zip(prompt_ids, bf16_outputs)]) >= 0.9


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
