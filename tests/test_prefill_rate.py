"""The engine's prefill-speed estimate (TTFT budgets and conditional disaggregation read it):
short prompts must not make a long one look slow."""

from __future__ import annotations

import pytest

from pdserve.engine.prefill_rate import PrefillRate

FIXED_S, TOKENS_PER_S = 0.012, 1400.0  # a step costs 12 ms whatever it holds, plus 1/1400 s per prompt token


def step_s(tokens: int) -> float:
    return FIXED_S + tokens / TOKENS_PER_S


@pytest.mark.parametrize("decode_steps", [5, 0], ids=["with-decode-steps", "prefill-worker"])
def test_short_prompts_do_not_drag_the_estimate_down(decode_steps):
    rate = PrefillRate()
    for _ in range(decode_steps):
        rate.observe(0, FIXED_S)
    for _ in range(10):
        rate.observe(3, step_s(3))  # short prompts: mostly fixed cost
    rate.observe(400, step_s(400))
    assert rate.tokens_per_s == pytest.approx(TOKENS_PER_S, rel=0.01)
    assert 3 / step_s(3) < 300  # what dividing a short prompt's tokens by its step time said
    for _ in range(10):  # more short ones after it: the long one still anchors the fit
        rate.observe(3, step_s(3))
    assert rate.tokens_per_s == pytest.approx(TOKENS_PER_S, rel=0.01)


def test_with_one_prompt_size_the_fixed_part_comes_from_decode_steps():
    rate = PrefillRate()
    assert rate.tokens_per_s == 0.0  # not measured yet: the router skips its budget check
    rate.observe(100, step_s(100))
    alone = rate.tokens_per_s  # no fixed part known: the slow side
    assert alone == pytest.approx(100 / step_s(100))
    rate.observe(0, FIXED_S)
    assert rate.tokens_per_s == pytest.approx(TOKENS_PER_S) and alone < TOKENS_PER_S
    rate.observe(0, 10.0)  # a decode step slower than the prefill: never a free or negative prefill
    assert 0 < rate.tokens_per_s <= 4 * 100 / step_s(100)
