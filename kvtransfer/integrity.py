"""Checksums of transferred K/V: xxh3-64 over host bytes, a cheap on-device sum for GPU paths."""

from __future__ import annotations

import torch
import xxhash


def checksum(views: list[memoryview]) -> int:
    """xxh3-64 of the concatenation of ``views`` (no copy)."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def device_checksum(rows: torch.Tensor) -> int:
    """A position-weighted sum of the 32-bit words of ``rows``, computed where they live (GPU):
    hashing on the host would cost a device-to-host copy of every byte."""
    words = rows.contiguous().view(torch.int32).flatten().to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) % 65521
    return int(((words * weights).sum() + words.numel()) & (2**63 - 1))
