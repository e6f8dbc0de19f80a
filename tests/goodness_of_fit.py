"""Pearson's goodness-of-fit test, for tests that check a sampler's output distribution."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's goodness-of-fit test (cells with zero expected mass must be empty)."""
    n = counts.sum()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token the distribution gives no mass was drawn"
    expected = expected_probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))
