"""How fast this engine prefills, for TTFT estimates (the router's budget check, conditional
disaggregation, the simulator's copy of both).

A step's time is a fixed part (the weights read once, the batch's decodes, Python) plus a part
per prompt token. Dividing a short prompt's tokens by its step's time measures mostly the fixed
part: a few short prompts would make a 400-token one look seconds away. So the per-token part
is fitted: a least-squares line through recent prefill steps (seconds against prompt tokens),
once their sizes differ enough to give it a slope; until then, the fixed part is taken from
recent decode-only steps and subtracted (a prefill worker runs none: its estimate stays on the
slow side until it has seen prompts of different sizes).
"""

from __future__ import annotations

PREFILL_WEIGHT = 0.1  # each prefill step's weight in the fit (about the last ten steps count)
DECODE_WEIGHT = 0.2  # the decode-only step time's moving average
MIN_SPREAD_TOKENS = 64.0  # prompt sizes must spread this much (std. dev.) to fit a slope


class PrefillRate:
    def __init__(self) -> None:
        self.decode_step_s = 0.0
        # Decayed sums over prefill steps: weight, tokens, seconds, tokens², tokens x seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """One forward step: ``prefill_tokens`` of prompt in it (0: a decode-only step)."""
        if prefill_tokens == 0:
            self.decode_step_s += DECODE_WEIGHT * (seconds - self.decode_step_s) if self.decode_step_s else seconds
            return
        keep, x = 1.0 - PREFILL_WEIGHT, float(prefill_tokens)
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * seconds

    @property
    def tokens_per_s(self) -> float:
        """0: not measured yet."""
        if not self._w:
            return 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread >= MIN_SPREAD_TOKENS**2:
            slope = (self._xy / self._w - mean_x * mean_y) / spread
            if slope > 0:
                return 1.0 / slope
        per_token = max(mean_y - self.decode_step_s, mean_y / 4) / mean_x  # never all fixed cost
        return 1.0 / per_token
