"""How one token's K and V are stored in a paged cache slot (the Python side of ``csrc/kv_format.h``).

- ``auto``: the model dtype; a cache layer is ``[num_blocks, block_size, 2, kv_heads, head_dim]``.
- ``int8`` / ``fp8`` (e4m3): one byte per value plus an fp32 scale per token, K/V and head; a
  layer is ``uint8 [num_blocks, block_size, token_bytes]`` and each token holds
  ``K codes [heads, dim] | V codes [heads, dim] | K scales [heads] | V scales [heads]``, zero
  padding to a multiple of 16 bytes.

Either way a token is one contiguous run of ``token_bytes``: KV transports move 8-bit caches,
scales included, exactly like plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.engine_config import KV_CACHE_DTYPES

_KIND = {"auto": 0, "int8": 1, "fp8": 2}  # the C++ kernels' KVFormat::Kind
_MAX_CODE = {"int8": 127.0, "fp8": 448.0}
SLOT_ALIGN = 16  # bytes an 8-bit cache slot is padded to (csrc/kv_format.h says the same)


def padded_slot(nbytes: int) -> int:
    """An 8-bit slot's size for ``nbytes`` of codes and scales: rounded up to SLOT_ALIGN, so a
    slot's codes start 16-byte aligned, as a GPU's vector loads assume (Triton read 3 KV heads'
    408-byte slots at misaligned addresses otherwise)."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True, slots=True)
class KVFormat:
    cache_dtype: str  # one of KV_CACHE_DTYPES
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype (and a plain cache's element type)

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def kind(self) -> int:
        return _KIND[self.cache_dtype]

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    @property
    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def fields_bytes(self) -> int:
        """An 8-bit slot's codes and scales (the padding follows)."""
        return self.values_per_token + 2 * self.num_kv_heads * 4

    @property
    def token_bytes(self) -> int:
        if self.quantized:
            return padded_slot(self.fields_bytes)
        return self.values_per_token * self.dtype.itemsize

    def slot_shape(self) -> tuple[int, ...]:
        """The trailing shape of one cache slot (token)."""
        return (self.token_bytes,) if self.quantized else (2, self.num_kv_heads, self.head_dim)

    # -- reference (torch) encode / decode --------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [T, H, D] -> slot contents: [T, 2, H, D] in the model dtype, or [T, token_bytes] uint8."""
        kv = torch.stack((k, v), dim=1)
        if not self.quantized:
            return kv.to(self.dtype)
        x = kv.float()
        amax = x.abs().amax(dim=-1)  # [T, 2, H]
        scale = amax / _MAX_CODE[self.cache_dtype]
        inv = torch.where(amax > 0, _MAX_CODE[self.cache_dtype] / amax, torch.zeros_like(amax))
        scaled = x * inv[..., None]
        if self.cache_dtype == "int8":
            codes = torch.round(scaled).to(torch.int8).view(torch.uint8)
        else:
            codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        tokens = k.shape[0]
        slots = torch.zeros(tokens, self.token_bytes, dtype=torch.uint8, device=k.device)
        n = self.values_per_token
        slots[:, :n] = codes.reshape(tokens, -1)
        slots[:, n : self.fields_bytes] = scale.contiguous().view(torch.uint8).reshape(tokens, -1)
        return slots

    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot contents (as ``encode`` returns them, any leading shape) -> k, v [..., H, D] in the model dtype."""
        if not self.quantized:
            return slots[..., 0, :, :], slots[..., 1, :, :]
        lead = slots.shape[:-1]
        n = self.values_per_token
        raw = slots.reshape(-1, self.token_bytes)
        codes = raw[:, :n]
        values = (codes.view(torch.int8) if self.cache_dtype == "int8" else codes.view(torch.float8_e4m3fn)).float()
        scales = raw[:, n : self.fields_bytes].contiguous().view(torch.float32)  # [N, 2 * H]
        kv = values.view(-1, 2, self.num_kv_heads, self.head_dim) * scales.view(-1, 2, self.num_kv_heads, 1)
        kv = kv.to(self.dtype).view(*lead, 2, self.num_kv_heads, self.head_dim)
        return kv[..., 0, :, :], kv[..., 1, :, :]
