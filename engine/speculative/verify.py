"""Which proposed tokens a decode keeps. Both rules leave the output distributed exactly as
plain decoding's.

**Matching** (greedy requests, seeded requests, n-gram proposals). Every position of the
verified chunk is sampled exactly as plain decoding would sample it (the same logits, the same
per-(seed, token index) noise); proposals are kept while they equal those samples, and the
first sample that differs is the next token. The output is the model's own samples, so it is
token-identical to decoding without speculation: greedy and seeded output do not depend on
how tokens were proposed, batched or split across workers, up to floating point: a verified
chunk's logits differ from one-token steps' in their last bits, which an fp8 KV cache's
rounding can turn into another token where two are nearly tied (as batching and chunked
prefill already can with fp8; unquantized and int8 caches held in tests). A draft model that draws its
proposals with the same noise (argmax(q / E) where the target draws argmax(p / E)) predicts
those samples; its hit rate is a coupling's, a little below rejection sampling's
sum(min(p, q)). For a proposal without a distribution (n-gram lookup: a point mass on d) the
hit rate p(d) is already the best any exact rule can do.

**Rejection sampling** (draft proposals of unseeded sampled requests; Leviathan et al. and
Chen et al., 2023). Proposal d_i ~ q_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
the first rejected one is replaced by a draw from the residual max(p_i - q_i, 0), normalized;
when all are kept, the model's own sample at the last position follows. Each emitted token
is distributed as p_i given the tokens before it.
"""

from __future__ import annotations

import torch

from pdserve.engine.sampler import inverse_transform


def accept_matching(draft: list[int], sampled: list[int]) -> list[int]:
    """``sampled[i]``: the model's sample at position i (len(draft) + 1 of them). Returns the
    proposals up to the first that differs from its sample, then that sample (or the last one)."""
    kept = 0
    while kept < len(draft) and draft[kept] == sampled[kept]:
        kept += 1
    return sampled[: kept + 1]


def rejection_sample(
    draft: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    bonus: int,
    generator: torch.Generator | None = None,
) -> list[int]:
    """``draft_probs``: [k, V], the distributions the proposals were drawn from;
    ``target_probs``: [k (+ 1), V], the model's at the same positions; ``bonus``: the model's
    own sample after the last proposal. Returns the kept proposals and one more token."""
    k = len(draft)
    device = target_probs.device
    rows = torch.arange(k, device=device)
    ids = torch.tensor(draft, device=device)
    p, q = target_probs[rows, ids], draft_probs[rows, ids]
    u = torch.rand(k, device=device, generator=generator)
    rejected = ((u * q > p) | (q <= 0)).nonzero()  # keep while u < p/q (q = 0: not drawn from q at all)
    if rejected.numel() == 0:
        return [*draft, bonus]
    i = int(rejected[0])
    residual = (target_probs[i] - draft_probs[i]).clamp_min_(0.0)
    if not residual.sum() > 0:  # p <= q everywhere yet rejected: only rounding gets here
        residual = target_probs[i]
    token = int(inverse_transform(residual[None], torch.rand(1, device=device, generator=generator)))
    return [*draft[:i], token]
