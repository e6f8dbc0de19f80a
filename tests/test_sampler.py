"""The sampler at the edges of its settings' ranges: every accepted value gives a real token."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler, sampling_probs
from pdserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),  # logits / temperature would overflow to inf
        SamplingParams(temperature=1e-6),
        SamplingParams(top_p=1e-46),  # 0 in float32: the nucleus would be empty
        SamplingParams(top_p=1e-30, top_k=3),
    ],
    ids=["temperature-1e-40", "temperature-1e-6", "top_p-1e-46", "top_p-1e-30-top_k"],
)
def test_extreme_accepted_settings_pick_the_most_likely_token(params):
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0], [4.0, 0.0, 1.0, 3.5]])
    ids = Sampler(torch.device("cpu"))(logits, [params, params], [0, 0])
    assert ids.tolist() == [1, 0]
    assert not sampling_probs(logits, [params, params]).isnan().any()


def test_a_tiny_top_p_keeps_only_the_first_token_and_a_full_one_keeps_all():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    probs = sampling_probs(logits, [SamplingParams(top_p=1e-46)])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]
    assert (sampling_probs(logits, [SamplingParams(top_p=1.0)]) > 0).all()
