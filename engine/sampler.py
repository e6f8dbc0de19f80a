"""Batched next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling draws ``argmax(probs / q)`` with ``q ~ Exponential(1)`` per vocabulary entry, which
is an exact sample from ``probs`` (the exponential race). The noise of a seeded request comes
from a generator keyed by (seed, index of the token being generated), so a seeded request
gives the same tokens whether its first token is drawn on a prefill worker and the rest on a
decode worker, after a preemption, or after a migration.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from pdserve.engine.sampling_params import SamplingParams


def token_seed(seed: int, index: int) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed, index)) & (2**63 - 1)


def seeded_noise_(row: torch.Tensor, generator: torch.Generator, seed: int, index: int) -> torch.Tensor:
    """Fills ``row`` (one vocabulary of probabilities' worth) with the noise of output token
    ``index`` of a request seeded ``seed`` (a speculative draft draws the same)."""
    generator.manual_seed(token_seed(seed, index))
    return row.exponential_(generator=generator)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
        """logits: [B, V] fp32; ``output_index[i]``: how many tokens row i has generated so far."""
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids

        device = logits.device
        probs = sampling_probs(logits, params)

        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        for i in seeded:
            seeded_noise_(noise[i], self._generator, params[i].seed, output_index[i])
        sampled = (probs / noise).argmax(dim=-1)

        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_ids, sampled)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k and top-p (greedy rows
    at temperature 1). Speculative decoding's rejection test compares these."""
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) everything outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device)
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=device, dtype=sorted_logits.dtype)
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below p; the most likely token always stays
    # (a top_p that rounds to 0 in the logits' dtype would drop every token).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= p[:, None]) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
