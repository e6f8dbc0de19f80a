"""How fast this engine prefills, for TTFT estimates (the router's budget check, conditional
disaggregation).

A step's time is a fixed part (the weights read once, the batch's decodes, Python) plus a part
per prompt token. Dividing a small prefill step's tokens by its time measures mostly the fixed
part: a few short prompts would make a 400-token one look seconds away. So the fixed part is
taken from recent decode-only steps and subtracted, and each prefill step counts by its share
of ``WEIGHT_TOKENS`` prompt tokens (a moving average normalized by the weight seen, so a first
short step does not set the estimate alone either).
"""

from __future__ import annotations

WEIGHT_TOKENS = 512  # a prefill step of this many tokens replaces the estimate outright
DECODE_WEIGHT = 0.2  # the decode-only step time's moving average


class PrefillRate:
    def __init__(self) -> None:
        self.decode_step_s = 0.0
        self._sum = self._weight = 0.0  # decayed sums of weight x rate, and of weight

    @property
    def tokens_per_s(self) -> float:
        """0: not measured yet."""
        return self._sum / self._weight if self._weight else 0.0

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """One forward step: ``prefill_tokens`` of prompt in it (0: a decode-only step)."""
        if prefill_tokens == 0:
            self.decode_step_s += DECODE_WEIGHT * (seconds - self.decode_step_s) if self.decode_step_s else seconds
            return
        per_token_s = max(seconds - self.decode_step_s, seconds / 4) / prefill_tokens  # never all fixed cost
        weight = min(1.0, prefill_tokens / WEIGHT_TOKENS)
        self._sum = (1 - weight) * self._sum + weight / max(per_token_s, 1e-9)
        self._weight = (1 - weight) * self._weight + weight
