"""Batched next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

torch's ``sort``, ``multinomial`` and ``exponential_`` cost 20–70 ns per vocabulary entry on
CPU: with a 49k vocabulary a sampled row took 1.2–5 ms, and a batch-32 step with top-p took 3.5
greedy steps. Here no row draws noise for every entry unless it is seeded, and top-k/top-p sort
only a row's best candidates:

- An unseeded row draws by inverse transform: one uniform u, and the first token whose
  cumulative probability exceeds u (a cumulative sum and a binary search). The sum runs in
  float64: float32's rounding would leave the smallest probabilities undrawable, and a CUDA
  scan of one row is not monotone in float32.
- A seeded row draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocabulary entry
  (the exponential race, exact), E = −log(u) with u a counter-based hash of (seed, index of the
  token being generated, vocabulary entry): a C++ kernel on CPU, the same hash in torch ops
  elsewhere. So a seeded request gives the same tokens whether its first token is drawn on a
  prefill worker and the rest on a decode worker, after a preemption, or after a migration
  (on workers of one version: the noise changed with this sampler), and a speculative draft
  can draw its proposal with the very same E, so that it predicts the target's own sample.
- Top-k and top-p look at each row's best candidates (``topk``), widening the candidate set,
  for the rows that need it, until it holds the whole nucleus (a flat row can widen to its
  whole vocabulary, which costs what a sort does).
"""

from __future__ import annotations

import math
import struct

import torch
import xxhash

from pdserve.engine.sampling_params import SamplingParams

CANDIDATES = 64  # top-k/top-p look at this many of a row's best tokens first
WIDEN = 8  # and this many times more while a row's nucleus is not inside them
BLOCK = 256  # tokens per block of the inverse transform's first level


def token_seed(seed: int, index: int) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed, index)) & (2**63 - 1)


# SplitMix64's constants, as the signed 64-bit values torch's int64 arithmetic wraps with.
_GOLDEN, _MIX1, _MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def seeded_noise(keys: list[tuple[int, int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] Exponential(1) noise; row i is that of output token ``index`` of a
    request seeded ``seed``, for ``keys[i] = (seed, index)`` (a speculative draft draws the same).
    u is an odd multiple of 2^-24 inside (0, 1), so the noise is finite and positive (and, as
    with any float32 uniform, a token below ~1e-7 of its row's best is never drawn). On CPU the
    C++ kernel computes it (kernels/csrc/race_noise_cpu.cpp; ~30x faster than a generator); the
    torch ops of ``hashed_noise`` compute the same u bit for bit, and −log u to within one unit
    in the last place of float32, so only a near-exact tie can draw differently on another
    device."""
    device = torch.device(device)
    row_keys = torch.tensor([token_seed(seed, index) for seed, index in keys], dtype=torch.int64)
    if device.type == "cpu":
        from pdserve.kernels import cpu_extension

        kernels = cpu_extension.load()
        if kernels is not None:
            out = torch.empty(len(keys), vocab, dtype=torch.float32)
            kernels.race_noise_(out, row_keys)
            return out
    return hashed_noise(row_keys.to(device), vocab)


def hashed_noise(row_keys: torch.Tensor, vocab: int, rows_at_once: int = 16) -> torch.Tensor:
    """``seeded_noise`` in torch ops, for ``row_keys`` (int64, one per row) on any device: a few
    rows at a time, in place, so its int64 temporaries stay small beside a large vocabulary."""
    out = torch.empty(len(row_keys), vocab, dtype=torch.float32, device=row_keys.device)
    golden = torch.arange(vocab, device=row_keys.device, dtype=torch.int64).mul_(_GOLDEN)
    for first in range(0, len(row_keys), rows_at_once):
        keys = row_keys[first : first + rows_at_once, None]
        x = golden.expand(len(keys), vocab) ^ keys
        shifted = torch.empty_like(x)
        for n, mix in ((30, _MIX1), (27, _MIX2), (31, None)):  # x ^= x >>> n, then x *= mix
            torch.bitwise_right_shift(x, n, out=shifted).bitwise_and_((1 << (64 - n)) - 1)
            x.bitwise_xor_(shifted)
            if mix is not None:
                x.mul_(mix)
        u = x.bitwise_right_shift_(41).bitwise_and_((1 << 23) - 1).bitwise_left_shift_(1).bitwise_or_(1)
        out[first : first + rows_at_once] = u.float().mul_(2.0**-24).log_().neg_()
    return out


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ([B, V], unnormalized is fine) for uniforms ``u`` ([B] in
    [0, 1)): the first token whose cumulative probability exceeds u times the row's mass.

    Two levels, in float64 (float32 would leave the smallest probabilities undrawable, and a
    CUDA scan of one long row is not monotone in float32): the sums of blocks of tokens find
    the block, then the sum inside that block finds the token. One pass over the row and no
    [B, V] temporary."""
    rows, vocab = probs.shape
    block = math.gcd(vocab, BLOCK)
    if block < BLOCK // 16:  # a vocabulary with few factors of 2: pad it
        probs, block = torch.nn.functional.pad(probs, (0, -vocab % BLOCK)), BLOCK
    blocks = probs.view(rows, -1, block)
    cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # [B, blocks]
    target = u[:, None].to(cdf) * cdf[:, -1:]
    which = torch.searchsorted(cdf, target, right=True).clamp_max_(cdf.shape[1] - 1)
    before = torch.where(which > 0, cdf.gather(1, (which - 1).clamp_min(0)), 0.0)
    inside = blocks[torch.arange(rows, device=probs.device), which.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)
    ids = which * block + torch.searchsorted(inside, target - before, right=True).clamp_max_(block - 1)
    ids.clamp_max_(vocab - 1)
    # Never a token without mass, whatever the sums' rounding: such a pick takes the row's best.
    # (A row that is NaN, a model's fault, keeps an id inside the vocabulary.)
    massless = (probs.gather(1, ids) <= 0).squeeze(1)
    if bool(massless.any()):
        ids[massless] = probs[massless].argmax(dim=-1, keepdim=True)
    return ids.squeeze(1)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":  # seeded noise's kernel: loaded (or built) now, not in a request's step
            from pdserve.kernels import cpu_extension

            cpu_extension.load()

    @torch.inference_mode()  # the model's logits are inference tensors: only there may they change in place
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int], *, overwrite: bool = False
    ) -> torch.Tensor:
        """logits: [B, V] fp32; ``output_index[i]``: how many tokens row i has generated so far;
        ``overwrite``: the caller is done with ``logits`` (they may be scaled and normalized in place)."""
        token_ids = logits.argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if not drawn:
            return token_ids
        # Whole rows where it can: each [B, V] temporary costs more in page faults than its math.
        every = len(drawn) == len(params)
        rows = logits if every else logits[drawn]  # a copy when indexed: ours to overwrite
        probs = sampling_probs(rows, [params[i] for i in drawn], overwrite=overwrite or not every)
        seeded = [(j, i) for j, i in enumerate(drawn) if params[i].seed is not None]
        if seeded:
            noise = seeded_noise([(params[i].seed, output_index[i]) for _, i in seeded], probs.shape[1], probs.device)
            rows_seeded = torch.tensor([j for j, _ in seeded], device=probs.device)
            winners = probs.index_select(0, rows_seeded).div_(noise).argmax(dim=-1)
            token_ids[torch.tensor([i for _, i in seeded], device=probs.device)] = winners
        unseeded = [j for j, i in enumerate(drawn) if params[i].seed is None]
        if unseeded:
            u = torch.rand(len(unseeded)).to(logits.device)
            if len(unseeded) == len(params):
                return inverse_transform(probs, u)
            token_ids[[drawn[j] for j in unseeded]] = inverse_transform(probs[unseeded], u)
        return token_ids


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams], *, overwrite: bool = False) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k and top-p (greedy rows
    at temperature 1). Speculative decoding's rejection test compares these. ``overwrite``:
    compute them in ``logits``' own memory."""
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    # Without ``overwrite``, this [B, V] is the one copy of every row; the rest is in place.
    probs = logits.div_(temperature[:, None]) if overwrite else logits / temperature[:, None]
    probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
    probs.div_(probs.sum(dim=-1, keepdim=True))
    vocab = probs.shape[1]
    filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if len(filtered) == len(params):
        return _restrict_(probs, [p.top_k for p in params], [p.top_p for p in params])
    if filtered:
        chosen = [params[i] for i in filtered]
        probs[filtered] = _restrict_(probs[filtered], [p.top_k for p in chosen], [p.top_p for p in chosen])
    return probs


def _restrict_(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Restricts each row's distribution, in place, to its top-k, then to the top-p nucleus of
    that (renormalized), as a sort of the whole row would. A row whose nucleus is not inside
    its first candidates is looked at again with more; the others are done."""
    vocab = probs.shape[1]
    device = probs.device
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=device)
    p = torch.tensor(top_p, device=device, dtype=probs.dtype)
    width = max([CANDIDATES] + [kk for kk in top_k if 0 < kk < vocab])
    pending = torch.arange(len(top_k), device=device)
    while True:
        width = min(width, vocab)
        every = len(pending) == len(top_k)
        kept, order, settled = _nucleus(probs if every else probs[pending], width, k[pending], p[pending])
        if width == vocab:
            settled[:] = True
        if every and bool(settled.all()):  # the usual case: in place, no [B, V] temporary
            probs.zero_().scatter_(1, order, kept)
            return probs.div_(probs.sum(dim=-1, keepdim=True))
        restricted = torch.zeros_like(probs[: int(settled.sum())]).scatter_(1, order[settled], kept[settled])
        probs[pending[settled]] = restricted.div_(restricted.sum(dim=-1, keepdim=True))
        pending = pending[~settled]
        if not len(pending):
            return probs
        width *= WIDEN


def _nucleus(probs: torch.Tensor, width: int, k: torch.Tensor, p: torch.Tensor):
    """For each row, its ``width`` most likely tokens (``order``) with their top-k/top-p
    probabilities (``kept``, 0 outside; not yet renormalized), and whether the row's nucleus
    lies inside them (``settled``: every token past them would be dropped anyway)."""
    values, order = probs.topk(width, dim=-1)  # sorted, most likely first
    ranks = torch.arange(width, device=probs.device)[None, :]
    has_k = k < probs.shape[1]
    values = values.masked_fill_(ranks >= k[:, None], 0.0)
    values = values.div_(torch.where(has_k, values.sum(dim=-1), 1.0)[:, None])  # top-p sees the top-k's mass
    covered = values.cumsum(dim=-1)
    # Keep a token while the mass before it is below p; the most likely token always stays
    # (a top_p that rounds to 0 in float32 would drop every token), and top_p 1 keeps the
    # tokens whose mass before them rounds to 1.
    keep = (covered - values < p[:, None]) | (ranks == 0) | (p[:, None] >= 1.0)
    return values.masked_fill_(~keep, 0.0), order, has_k | (covered[:, -1] >= p)
