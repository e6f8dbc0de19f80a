"""How many tokens a sequence proposes, and when it stops proposing.

A verification costs more than a plain decode step: its chunk runs k + 1 tokens through the
model instead of one (and on CPU, through the Python layers rather than the fused C++ decode
loop). It pays when enough proposals are kept. Each sequence keeps a moving average of the
proposals kept per verification:

- it proposes at most one token more than that average (rounded up), never more than K, so a
  sequence whose proposals are mostly rejected stops paying for long ones;
- when the average falls below ``min_accepted``, the sequence stops proposing for
  ``FIRST_PAUSE`` steps, twice as long after each further failure (up to ``MAX_PAUSE``); one
  verification after the pause decides again. On text the proposer cannot predict, that bounds
  the cost to one verification per pause.

An n-gram proposer that finds no match proposes nothing, at no cost; only verifications count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EMA_WEIGHT = 0.3  # weight of the newest verification in the average
INITIAL_MEAN = 1.5  # a new sequence proposes 3 tokens; it takes four rejected verifications to pause
FIRST_PAUSE = 4  # steps
MAX_PAUSE = 256
# Kept proposals per verification below which a sequence pauses. Measured on CPU (bench/RESULTS.md):
# a verification with a few proposals costs about 1.3 plain steps at batch 1.
MIN_ACCEPTED = 0.5


@dataclass(slots=True)
class Acceptance:
    """One sequence's record."""

    mean: float  # moving average of proposals kept per verification
    pause: int = 0  # steps left without proposals
    failures: int = 0  # pauses in a row


class Backoff:
    def __init__(self, max_tokens: int, min_accepted: float = MIN_ACCEPTED) -> None:
        self.max_tokens = max_tokens
        self.min_accepted = min_accepted

    def new(self) -> Acceptance:
        return Acceptance(mean=INITIAL_MEAN)

    def lookahead(self, record: Acceptance) -> int:
        """Tokens the sequence may propose this step (0 while paused; counts the pause down)."""
        if record.pause:
            record.pause -= 1
            return 0
        return min(self.max_tokens, math.ceil(record.mean) + 1)

    def update(self, record: Acceptance, accepted: int) -> None:
        """After a verification that kept ``accepted`` proposals."""
        record.mean += EMA_WEIGHT * (accepted - record.mean)
        if record.mean >= self.min_accepted:
            record.failures = 0
            return
        record.pause = min(MAX_PAUSE, FIRST_PAUSE << record.failures)
        record.failures += 1
        record.mean = self.min_accepted  # after the pause, the next verification decides
