"""Engine settings shared by every worker role."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model; else a Hugging Face folder or a .gguf file
    dtype: str = "float32"
    device: str = "auto"  # auto: CUDA when present, else CPU
    block_size: int = 16
    kv_cache_memory: str = "auto"  # '2GiB', a byte count, or a fraction of free memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto, torch, triton
    cache_dir: str | None = None
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
