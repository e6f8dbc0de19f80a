"""The Python client's request builder: every field lands where the proto has it, and what
cannot be sent is a ValueError naming the field (no server needed)."""

from __future__ import annotations

import pytest

from pdserve.client import Client, build_request


def test_request_options_go_on_the_request_and_the_rest_on_sampling():
    req = build_request(
        messages=[{"role": "assistant", "content": "Once"}],
        ttft_budget_ms=250.0,
        add_generation_prompt=False,
        continue_final_message=True,
        max_tokens=7,
        stop="END",
    )
    assert req.ttft_budget_ms == 250.0 and req.HasField("ttft_budget_ms")
    assert req.HasField("add_generation_prompt") and not req.add_generation_prompt
    assert req.continue_final_message
    assert req.sampling.max_tokens == 7 and list(req.sampling.stop) == ["END"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(messages=[{"role": "user"}]), "messages[0]: missing 'content'"),
        (dict(messages=[{"content": "hi"}]), "messages[0]: missing 'role'"),
        (dict(ttft_budget_ms="soon"), "ttft_budget_ms: "),
        (dict(max_tokens="7"), "sampling.max_tokens: "),
        (dict(temprature=0.5), "sampling.temprature: no such field"),
    ],
)
def test_what_cannot_be_sent_is_a_value_error_naming_the_field(kwargs, words):
    with pytest.raises(ValueError) as e:
        build_request("hi" if "messages" not in kwargs else None, **kwargs)
    assert str(e.value).startswith(words)


def test_generate_judges_n_after_building_the_request():
    with Client("127.0.0.1:1") as client:  # nothing listens: the refusals come before any call
        with pytest.raises(ValueError, match="^sampling.n: "):
            client.generate("hi", n="2")
        with pytest.raises(ValueError, match="^n: generate.. returns one choice"):
            client.generate("hi", n=2)
