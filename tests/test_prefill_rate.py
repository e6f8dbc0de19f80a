"""The engine's prefill-speed estimate (TTFT budgets and conditional disaggregation read it):
small steps must not make a long prompt look slow."""

from __future__ import annotations

import pytest

from pdserve.engine.prefill_rate import PrefillRate


def test_short_prompts_do_not_drag_the_estimate_down():
    """A step costs ~12 ms whatever it holds, plus 1 ms per 1.4 prompt tokens (1400 tokens/s)."""
    rate = PrefillRate()
    for _ in range(5):
        rate.observe(0, 0.012)  # decode-only steps: the fixed part
    for _ in range(10):
        rate.observe(3, 0.012 + 3 / 1400)  # short prompts: mostly fixed cost
    rate.observe(400, 0.012 + 400 / 1400)
    assert rate.tokens_per_s == pytest.approx(1400, rel=0.05)
    # Dividing tokens by step time (the old estimate) gave about 250 tokens/s for the same steps.
    assert 3 / (0.012 + 3 / 1400) < 300


def test_each_step_counts_by_its_tokens():
    rate = PrefillRate()
    rate.observe(512, 0.5)  # 1024 tokens/s, no decode steps seen: all of the time is prefill
    assert rate.tokens_per_s == pytest.approx(1024)
    rate.observe(64, 64 / 512)  # a smaller step, half as fast: moves the estimate an eighth of the way
    assert rate.tokens_per_s == pytest.approx(1024 + (512 - 1024) * 64 / 512)
    rate.observe(0, 10.0)  # a slow decode step cannot make a prefill look free or negative
    rate.observe(100, 1.0)
    assert 0 < rate.tokens_per_s < 1024
