"""Engine settings shared by every worker role."""

from __future__ import annotations

from dataclasses import dataclass, field

QUANTIZATIONS = ("none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = _opt(None, "model: a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    dtype: str = _opt("auto", "weights and KV cache dtype; auto: bfloat16 where the hardware has it, else float32 (CPU) / float16 (GPU)", ("auto", "float32", "bfloat16", "float16"))
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto (the model dtype), or int8/fp8 values with per-token, per-head scales (half the memory and transfer bytes)", KV_CACHE_DTYPES)
    quantization: str = _opt("none", "weight quantization of the linear layers: int8 (per channel), int4 (groups of 32; a GGUF's own Q4/Q8 blocks are kept)", QUANTIZATIONS)
    device: str = _opt("auto", "torch device; auto picks CUDA when present")
    block_size: int = _opt(16, "KV cache block size in tokens")
    kv_cache_memory: str = _opt("auto", "KV cache budget: '2GiB', bytes, or a fraction of free memory")
    max_num_seqs: int = _opt(64, "most sequences in one running batch")
    max_num_batched_tokens: int = _opt(1024, "token budget of one forward pass (chunked prefill)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of shared prompt prefixes")
    preemption_mode: str = _opt("auto", "when KV blocks run out: swap to host memory or recompute; auto: swap on GPUs",
                                ("auto", "swap", "recompute"))
    swap_space: str = _opt("4GiB", "host memory for swapped-out KV blocks (preemption_mode swap)")
    attention_backend: str = _opt("auto", "attention kernels", ("auto", "torch", "cpu", "triton"))
    cache_dir: str | None = _opt(None, "where converted models are kept (default ~/.cache/pdserve)")
    num_threads: int | None = _opt(None, "torch CPU threads for this process")
    # Speculative decoding (engine/speculative): decoding sequences propose tokens that one
    # forward pass of the model verifies. Decode roles only; a prefill worker ignores it.
    speculative: str = _opt("none", "speculative decoding: ngram (prompt lookup in the prompt and output so far) or "
                            "draft (a smaller model, --draft-model)", SPECULATIVE_METHODS)
    num_speculative_tokens: int = _opt(4, "speculative decoding: most tokens proposed per sequence and step")
    draft_model: str | None = _opt(None, "the draft model of --speculative draft: a Hugging Face folder or .gguf with "
                                   "the target's vocabulary ('default': the default model)")
    prompt_lookup_min: int = _opt(2, "speculative ngram: shortest suffix n-gram looked up")
    prompt_lookup_max: int = _opt(4, "speculative ngram: longest suffix n-gram looked up (the longest match wins)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("draft_model: --speculative draft needs a draft model (--draft-model PATH)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
