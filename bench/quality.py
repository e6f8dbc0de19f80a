"""Model quality figures printed beside every speed figure: perplexity on a fixed text and
how often a quantized model's next-token choice agrees with the unquantized one.

The fixed text is Python's own ``pydoc_data.topics`` (on every machine, ~700 k characters).
Perplexity is computed in non-overlapping windows, each run through the engine's model in
chunks of ``CHUNK`` tokens with logits at every position (earlier context from the KV cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


# Tokens per forward pass when scoring a text: the rest of each window's context is read back
# from the KV cache, as decoding does, so an 8-bit cache's error shows in the figures.
CHUNK = 16


@torch.inference_mode()
def token_logits(engine: LLMEngine, token_ids: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """fp32 logits [T, V] for every position of one sequence (position i predicts token i + 1)."""
    n = len(token_ids)
    bs = engine.config.block_size
    blocks = engine.blocks.allocate_blocks_raw(engine.blocks.blocks_needed(n))
    try:
        device = engine.device
        table = torch.tensor(blocks, dtype=torch.int64, device=device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        out = []
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            positions = torch.arange(start, end, device=device)
            batch = ForwardBatch(
                input_ids=ids[start:end],
                positions=positions,
                slot_mapping=table[positions // bs] * bs + positions % bs,
                num_decode=0,
                decode_block_tables=None,
                decode_context_lens=None,
                prefills=[PrefillSegment(query_start=0, num_query=end - start, context_len=end, block_table=table)],
                logits_indices=torch.arange(end - start, device=device),
            )
            out.append(engine.model(batch, engine.kv_cache.layers))
        return torch.cat(out)
    finally:
        engine.blocks.free_blocks(blocks)


@dataclass(frozen=True, slots=True)
class Perplexity:
    tokens: int
    nll: float  # mean negative log-likelihood per predicted token

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def perplexity(engine: LLMEngine, token_ids: list[int], window: int = 1024) -> Perplexity:
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = token_logits(engine, chunk)
        target = torch.tensor(chunk[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
        count += len(chunk) - 1
    return Perplexity(count, total / count)


def top1_agreement(engine: LLMEngine, reference: LLMEngine, sequences: list[list[int]]) -> float:
    """Share of positions where both models pick the same next token, both reading the same
    text (teacher forcing: one early difference does not compound into every later token)."""
    same = total = 0
    for ids in sequences:
        a = token_logits(engine, ids).argmax(-1)
        b = token_logits(reference, ids).argmax(-1)
        same += int((a == b).sum())
        total += len(ids)
    return same / total


# Instruction prompts for the greedy comparison (chat-formatted by the model's template).
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three uses of a paperclip.",
)
# (label, quantization, kv_cache_dtype, allowed perplexity increase over the unquantized model)
CONFIGS = (
    ("unquantized", "none", "auto", 0.0),
    ("int8", "int8", "auto", 0.02),
    ("int4", "int4", "auto", 0.08),
    ("kv-int8", "none", "int8", 0.01),
    ("kv-fp8", "none", "fp8", 0.01),
)


def greedy(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    engine.add_request("quality", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def quality(args) -> dict:
    """Perplexity (a fixed text of ``args.text_tokens`` tokens), greedy agreement with the
    unquantized model on the prompts above, and the gates, for every quantization."""
    from transformers import AutoTokenizer

    from pdserve.bench.engine_bench import dtype_name, make_engine
    from pdserve.engine.model_store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    text_ids = tokenizer(fixed_text()).input_ids[: args.text_tokens]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    rows = {}
    reference = None
    for label, quant, kv, allowed in CONFIGS:
        engine = make_engine(args.dtype, args.threads, quantization=quant, kv_cache_dtype=kv, kv_cache_memory="512MiB")
        ppl = perplexity(engine, text_ids)
        outputs = [greedy(engine, ids, 64) for ids in prompts]
        if reference is None:
            reference, ref_engine, ref_ppl, ref_outputs = label, engine, ppl, outputs
        same = sum(a == b for got, want in zip(outputs, ref_outputs) for a, b in zip(got, want))
        increase = ppl.ppl / ref_ppl.ppl - 1
        rows[label] = {
            "perplexity": round(ppl.ppl, 3),
            "tokens": ppl.tokens,
            "increase": round(increase, 4),
            "gate": f"<= +{allowed:.0%}",
            "gate_met": increase <= allowed,
            "greedy_identical_share": round(same / sum(map(len, ref_outputs)), 3),
            "top1_agreement": round(
                top1_agreement(engine, ref_engine, [p + o for p, o in zip(prompts, ref_outputs)]), 4
            ),
        }
    return {
        "bench": "quality",
        "dtype": dtype_name(ref_engine),
        "reference": reference,
        "text": "pydoc_data.topics",
        "configs": rows,
    }
