"""The request rules both sides apply (pdserve/request_rules.py): each refusal names the field,
the router and SamplingParams use the same words, and the vocabulary and context bounds apply
once the model's figures are known."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import (
    DEFAULT_MAX_TOKENS,
    InvalidRequest,
    check_priority,
    check_prompt_tokens,
    check_request_id,
    check_sampling,
    check_ttft_budget_ms,
    default_max_tokens,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-5), "seed"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(max_tokens=0), "sampling.max_tokens", "must be an integer >= 1, got 0"),
        (dict(max_tokens=True), "sampling.max_tokens", "must be an integer >= 1"),
        (dict(temperature=math.nan), "sampling.temperature", "must be in [0, 100], got nan"),
        (dict(temperature=100.5), "sampling.temperature", "must be in [0, 100]"),
        (dict(top_p=math.inf), "sampling.top_p", "must be in (0, 1], got inf"),
        (dict(top_k=2.0), "sampling.top_k", "must be an integer >= 0 (0 = off)"),
        (dict(seed=2**63), "sampling.seed", "must be an integer in [0, 2**63)"),
        (dict(stop=("x",) * 17), "sampling.stop", "17 stop strings exceed the limit of 16"),
        (dict(stop=("ok", "x" * 257)), "sampling.stop[1]", "must be 1 to 256 characters"),
        (dict(stop_token_ids=(1,) * 65), "sampling.stop_token_ids", "65 ids exceed the limit of 64"),
        (dict(stop_token_ids=(3, -1)), "sampling.stop_token_ids", "token id -1 is outside the token ids (>= 0)"),
    ],
)
def test_sampling_refusals_name_the_field_in_the_routers_words(kwargs, field, words):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and str(err.value) == f"{field}: {err.value.problem}"
    assert words in err.value.problem


def test_model_bounds_apply_once_the_model_is_known():
    fine = SamplingParams(max_tokens=10, top_k=50_000, stop_token_ids=(49_151,))  # nothing model-bound checked yet
    check_sampling(fine, vocab_size=50_000, prompt_len=8182, max_model_len=8192)
    with pytest.raises(
        InvalidRequest,
        match=r"^sampling.max_tokens: 10 new tokens after a 8183-token prompt exceed the context of 8192$",
    ):
        check_sampling(fine, vocab_size=50_000, prompt_len=8183, max_model_len=8192)
    with pytest.raises(InvalidRequest, match=r"^sampling.top_k: must be an integer in \[0, 49152\]"):
        fine.check_vocab(49_152)
    with pytest.raises(
        InvalidRequest, match=r"^sampling.stop_token_ids: token id 49151 is outside the vocabulary \[0, 1000\)"
    ):
        check_sampling(SamplingParams(stop_token_ids=(49_151,)), vocab_size=1000)


def test_prompt_tokens_and_request_fields():
    check_prompt_tokens([0, 5, 9], vocab_size=10, max_model_len=4)
    for ids, words in (
        ([], "holds no tokens"),
        ([1, 10], "token id 10 is outside the vocabulary [0, 10)"),
        ([1, 2, 3, 4], "4 tokens leave no room in the model's context of 4"),
    ):
        with pytest.raises(InvalidRequest) as err:
            check_prompt_tokens(ids, vocab_size=10, max_model_len=4, field="messages")
        assert err.value.field == "messages" and words in err.value.problem
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidRequest, match="^ttft_budget_ms: "):
            check_ttft_budget_ms(bad)
    check_ttft_budget_ms(5e-324)
    with pytest.raises(InvalidRequest, match=r"^priority: 101 is outside \[-100, 100\]"):
        check_priority(101)
    with pytest.raises(InvalidRequest, match="^request_id: "):
        check_request_id("a\nb")
    assert default_max_tokens(10, 8192) == DEFAULT_MAX_TOKENS and default_max_tokens(8000, 8192) == 192
