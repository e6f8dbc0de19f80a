"""Engine settings shared by every worker role, and the name lists they choose from.

Torch-free: the CLI and the router import it. Each field becomes a flag, an environment
variable and a YAML key (pdserve/config.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from pdserve.config import setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
PREEMPTION_MODES = ("auto", "swap", "recompute")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = setting(None, "model: a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    dtype: str = setting(
        "auto",
        "weights and KV cache dtype; auto: bfloat16 where the hardware has it, else float32 (CPU) / float16 (GPU)",
        choices=DTYPES,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache storage: auto (the model dtype), or int8/fp8 values with per-token, per-head scales (half the memory and transfer bytes)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str = setting(
        "none",
        "weight quantization of the linear layers: int8 (per channel), int4 (groups of 32; a GGUF's own Q4/Q8 blocks are kept)",
        choices=QUANTIZATIONS,
    )
    device: str = setting("auto", "torch device; auto picks CUDA when present")
    block_size: int = setting(16, "KV cache block size in tokens")
    kv_cache_memory: str = setting("auto", "KV cache budget: '2GiB', bytes, or a fraction of free memory")
    max_num_seqs: int = setting(64, "most sequences in one running batch")
    max_model_len: int | None = setting(
        None, "the context (prompt + output) in tokens, at most the model's own (default: the model's)"
    )
    max_num_batched_tokens: int = setting(1024, "token budget of one forward pass (chunked prefill)")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps")
    enable_prefix_caching: bool = setting(True, "reuse the KV of shared prompt prefixes")
    preemption_mode: str = setting(
        "auto", "when KV blocks run out: swap to host memory or recompute; auto: swap on GPUs", choices=PREEMPTION_MODES
    )
    swap_space: str = setting("4GiB", "host memory for swapped-out KV blocks (preemption_mode swap)")
    attention_backend: str = setting("auto", "attention kernels", choices=ATTENTION_BACKENDS)
    cache_dir: str | None = setting(None, "where converted models are kept (default ~/.cache/pdserve)")
    num_threads: int | None = setting(None, "torch CPU threads for this process")
    borrow_threads: int | None = setting(
        None,
        "torch CPU threads a decode step may take while no prefill is filling this worker's cache "
        "(the cores of an idle prefill worker on the same machine; pdserve up sets it)",
    )
    share_cores: bool | None = setting(
        None,
        "this worker's CPU threads sleep while they wait instead of spinning (OpenMP's passive wait "
        "policy), so a worker sharing its cores computes at full speed beside it; unset: off, but "
        "pdserve up turns it on for prefill workers beside unpinned CPU decode workers and gives "
        "them the prefill pool's split of every core, so they take the cores the decode workers leave idle",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks (one process each) that split every layer: attention heads and MLP columns, "
        "one all-reduce after each (Megatron)",
    )
    pipeline_parallel_size: int = setting(
        1, "ranks (one process each) that take consecutive layers, the batch passed between them in micro-batches"
    )
    # Speculative decoding (engine/speculative): decoding sequences propose tokens that one
    # forward pass of the model verifies. Decode roles only; a prefill worker ignores it.
    speculative: str = setting(
        "none",
        "speculative decoding: ngram (prompt lookup in the prompt and output so far) or "
        "draft (a smaller model, --draft-model)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = setting(4, "speculative decoding: most tokens proposed per sequence and step")
    draft_model: str | None = setting(
        None,
        "the draft model of --speculative draft: a Hugging Face folder or .gguf with "
        "the target's vocabulary ('default': the default model)",
    )
    prompt_lookup_min: int = setting(2, "speculative ngram: shortest suffix n-gram looked up")
    prompt_lookup_max: int = setting(4, "speculative ngram: longest suffix n-gram looked up (the longest match wins)")

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_memory != "auto":
            parse_memory(self.kv_cache_memory)
        if parse_memory(self.swap_space, "swap_space")[1] is not None:
            raise ValueError(f"swap_space must be a size such as '4GiB', got {self.swap_space!r}")
        for name in ("num_threads", "borrow_threads", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size > 1 and self.preemption_mode == "swap":
            raise ValueError(
                "preemption_mode swap keeps one rank's KV cache: with tensor or pipeline parallelism use recompute"
            )
        if (
            not isinstance(self.num_speculative_tokens, int)
            or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("draft_model: --speculative draft needs a draft model (--draft-model PATH)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.world_size > 1 and self.speculative != "none":
            raise ValueError(
                "speculative decoding runs in single-rank workers: with tensor or pipeline parallelism "
                "use --speculative none"
            )

    @property
    def world_size(self) -> int:
        """Processes of one worker: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: str | int | float, name: str = "kv_cache_memory") -> tuple[int | None, float | None]:
    """'2GiB' / '512MiB' / '1e9' / 123 -> (bytes, None); '0.3' (a fraction of free memory) -> (None, 0.3)."""
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(
            f"{name} must look like '2GiB', '512MiB', a byte count, or a fraction in (0, 1]; got {value!r}"
        )
    number, unit = float(match.group(1)), match.group(2)
    if not unit and "." in match.group(1):
        if 0 < number <= 1:
            return None, number
        raise ValueError(f"{name}: {value!r} is neither a fraction in (0, 1] nor a whole byte count")
    if number * _UNITS[unit] > 2**63:  # also "1e999": infinity
        raise ValueError(f"{name} is too large: {value!r}")
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size, None
