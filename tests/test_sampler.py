"""The sampler: every accepted setting gives a real token, draws follow the distribution, and
the fast top-k/top-p and inverse-transform paths agree with their textbook definitions."""

from __future__ import annotations

import math

import pytest
import torch
from fuzzing import fuzz
from goodness_of_fit import chi_square_p
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine import sampler as sampler_module
from pdserve.engine.sampler import Sampler, hashed_noise, inverse_transform, sampling_probs, seeded_noise, token_seed
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


def sorted_reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p by sorting the whole row: the textbook definition."""
    values, order = logits.sort(descending=True)
    if top_k > 0:
        values[top_k:] = float("-inf")
    if top_p < 1.0:
        probs = values.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs >= top_p) & (torch.arange(len(values)) > 0)
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, values).softmax(dim=-1)


ROW = st.tuples(
    st.sampled_from([0.01, 1.0, 8.0]),  # spread: flat rows widen the candidate set, up to the whole vocabulary
    st.sampled_from([0, 1, 7, 150]),  # top_k
    st.sampled_from([1e-9, 0.3, 0.9, 0.999, 1.0]),  # top_p
)


@fuzz(60)
@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([5, 200, 3000]), rows=st.lists(ROW, min_size=4, max_size=4))
def test_top_k_top_p_match_a_sort_of_the_whole_row(seed, vocab, rows):
    noise = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
    logits = noise * torch.tensor([spread for spread, _, _ in rows])[:, None]
    params = [SamplingParams(top_k=top_k, top_p=top_p) for _, top_k, top_p in rows]
    probs = sampling_probs(logits, params)
    for row, p in enumerate(params):
        expected = sorted_reference(logits[row], p.top_k if p.top_k < vocab else 0, p.top_p)
        ours, theirs = probs[row] > 0, expected > 0
        # only the token at the nucleus's edge may differ, where the mass before it rounds to p
        assert int((ours ^ theirs).sum()) <= 1, f"row {row}: a different set of tokens kept"
        both = ours & theirs
        torch.testing.assert_close(probs[row][both], expected[both], rtol=1e-3, atol=1e-6)


def test_top_k_with_top_p_1_keeps_tokens_whose_mass_before_rounds_to_1():
    logits = torch.tensor(
        [[0.0] + [-30.0 - i for i in range(9)]]
    )  # after the first, the running mass is 1.0 in float32
    probs = sampling_probs(logits, [SamplingParams(top_k=5, top_p=1.0)])
    assert (probs[0, :5] > 0).all() and (probs[0, 5:] == 0).all()


def test_a_wide_nucleus_is_found_past_the_first_candidates_beside_a_narrow_one():
    logits = torch.zeros(2, 5000)  # row 0 flat: top_p 0.5 keeps half, far past the first 64 candidates
    logits[1, 7], logits[1, 9] = 30.0, 29.0  # row 1: two tokens hold the nucleus
    probs = sampling_probs(logits, [SamplingParams(top_p=0.5), SamplingParams(top_p=0.9)])
    kept = int((probs[0] > 0).sum())
    assert sampler_module.CANDIDATES < 2500 <= kept <= 2501  # the 2501st: the mass before it rounds below 0.5
    assert (probs[1] > 0).nonzero().flatten().tolist() == [7, 9]
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))


def test_inverse_transform_picks_the_token_whose_interval_holds_u():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]]).repeat(5, 1)
    below_one = 1.0 - 2.0**-24  # the largest float32 uniform
    u = torch.tensor([0.0, 0.2499, 0.25, 0.74, below_one])
    assert inverse_transform(probs, u).tolist() == [1, 1, 3, 3, 4]
    assert inverse_transform(probs * 3, torch.full((5,), below_one)).tolist() == [4] * 5  # unnormalized


def test_inverse_transform_stays_inside_the_vocabulary_on_rows_without_mass():
    rows = torch.tensor([[float("nan")] * 4, [0.0] * 4])  # a model's NaN; a row nothing is allowed in
    assert all(0 <= i < 4 for i in inverse_transform(rows, torch.tensor([0.5, 0.5])).tolist())


@pytest.mark.parametrize("seed", [None, 7])
def test_a_row_with_one_allowed_token_always_draws_it(seed):
    """A grammar that allows one token (the rest -inf). Seeded: (seed 7, token 107) is a draw
    whose uniform noise holds an exact 0 at that token, which made its noise infinite."""
    vocab, allowed, index = 151_936, 73_305, 107
    logits = torch.full((4, vocab), float("-inf"))
    logits[:, allowed] = 0.0
    ids = Sampler(torch.device("cpu"))(logits, [SamplingParams(seed=seed)] * 4, [index] * 4)
    assert ids.tolist() == [allowed] * 4


def test_unseeded_draws_follow_the_distribution():
    logits = torch.tensor([2.0, 0.5, -1.0, 1.5, -30.0, 0.0]).log_softmax(dim=-1)
    rows = 6000
    params = [SamplingParams(temperature=0.8, top_k=4)] * rows
    torch.manual_seed(0)  # unseeded rows draw from torch's global generator
    ids = Sampler(torch.device("cpu"))(logits.repeat(rows, 1), params, [0] * rows)
    counts = torch.bincount(ids, minlength=6).double()
    assert chi_square_p(counts, sampling_probs(logits[None], params[:1])[0].double()) > 1e-3


def test_seeded_draws_follow_the_distribution_and_repeat():
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, 0.0])
    rows = 5000
    params = [SamplingParams(seed=5)] * rows
    sampler = Sampler(torch.device("cpu"))
    ids = sampler(logits.repeat(rows, 1), params, list(range(rows)))
    assert chi_square_p(torch.bincount(ids, minlength=5).double(), logits.softmax(dim=-1).double()) > 1e-3
    again = Sampler(torch.device("cpu"))(logits.repeat(rows, 1), params, list(range(rows)))
    assert torch.equal(ids, again)


def test_seeded_noise_is_exponential_and_keyed_by_seed_and_index():
    noise = seeded_noise([(3, 17), (3, 17), (3, 18), (4, 17)], 200_003)
    assert noise.shape == (4, 200_003) and bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert abs(float(noise[0].mean()) - 1.0) < 0.01 and abs(float(noise[0].var()) - 1.0) < 0.02
    # Exponential's quantiles: P(E > 1) = 1/e, P(E > 3) = e^-3.
    assert abs(float((noise[0] > 1).double().mean()) - math.exp(-1)) < 0.004
    assert abs(float((noise[0] > 3).double().mean()) - math.exp(-3)) < 0.002
    assert torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])
    # Rows are independent of each other: no correlation between neighbouring keys.
    assert abs(float(torch.corrcoef(noise[[0, 2]])[0, 1])) < 0.01


def test_seeded_noise_kernel_and_torch_ops_agree():
    """The C++ kernel (CPU) and the torch ops (every other device) hash to the same u; their
    logarithms agree to float32 rounding, so their races pick the same tokens."""
    from pdserve.kernels import cpu_extension

    assert cpu_extension.load() is not None, "the C++ kernels must build on this machine"
    keys = [(0, 0), (1, 5), (2**62, 3), (7, 2**40)] + [(s, s * 7) for s in range(60)]
    kernel = seeded_noise(keys, 1001)  # a vocabulary that is not a multiple of the kernel's 16 lanes
    ops = hashed_noise(torch.tensor([token_seed(s, i) for s, i in keys]), 1001, rows_at_once=5)
    torch.testing.assert_close(kernel, ops, rtol=1e-6, atol=0)
    probs = torch.softmax(torch.randn(len(keys), 1001, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert torch.equal((probs / kernel).argmax(dim=-1), (probs / ops).argmax(dim=-1))


def test_overwriting_the_logits_draws_the_same_tokens_and_only_then_changes_them():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(seed=4), SamplingParams()]
    kept = logits.clone()
    torch.manual_seed(1)
    untouched = Sampler(torch.device("cpu"))(logits, params, [0, 1, 2, 3])
    assert torch.equal(logits, kept)
    torch.manual_seed(1)
    overwritten = Sampler(torch.device("cpu"))(logits, params, [0, 1, 2, 3], overwrite=True)
    assert torch.equal(untouched, overwritten)
    assert not torch.equal(logits, kept)


def test_each_row_of_a_mixed_batch_draws_as_it_would_alone():
    """Greedy, seeded, unseeded and top-p rows in one batch: each row's token is the one its
    own rules give (unseeded rows take the batch's uniforms in order)."""
    vocab = 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=11),
        SamplingParams(temperature=0.9),
        SamplingParams(top_p=0.5, seed=12),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0),
    ]
    index = [5, 6, 7, 8, 9, 10]
    torch.manual_seed(2)
    ids = Sampler(torch.device("cpu"))(logits, params, index).tolist()
    assert ids[0] == int(logits[0].argmax()) and ids[5] == int(logits[5].argmax())
    for row in (1, 3):
        alone = Sampler(torch.device("cpu"))(logits[row : row + 1], [params[row]], [index[row]])
        assert ids[row] == int(alone[0])
    torch.manual_seed(2)
    u = torch.rand(2)
    for row, draw in ((2, u[0:1]), (4, u[1:2])):
        assert ids[row] == int(inverse_transform(sampling_probs(logits[row : row + 1], [params[row]]), draw)[0])


def test_the_sampling_step_leaves_a_verified_chunks_logits_as_the_model_gave_them():
    """The sampler may work in the logits' memory only when nothing reads them afterwards: a
    chunk with proposals hands its rows to verification, which needs the model's own."""
    from pdserve.engine.sampling_step import SamplingStep
    from pdserve.engine.scheduler import ScheduledChunk
    from pdserve.engine.sequence import Sequence

    seen = []
    step = SamplingStep(Sampler(torch.device("cpu")))
    step.verify = lambda chunk, sampled, rows: seen.append(rows.clone()) or sampled[:1]
    seq = Sequence("r", list(range(10, 20)), 8, SamplingParams(temperature=0.8))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    model_gave = logits.clone()
    step(logits, [ScheduledChunk(seq, 9, 3, lookahead=2, draft=[4, 5])])
    assert torch.equal(seen[0], model_gave) and torch.equal(logits, model_gave)
    # without proposals, the same rows are the sampler's to overwrite
    alone = model_gave[:1].clone()
    step(alone, [ScheduledChunk(seq, 9, 1)])
    assert not torch.equal(alone, model_gave[:1])


@pytest.mark.parametrize("vocab", [7, 3001, 4096, 49_152])  # padded to whole blocks, or split into them
def test_inverse_transform_agrees_with_a_float64_sum_of_the_whole_row(vocab):
    generator = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(64, vocab, generator=generator) * 3).softmax(dim=-1)
    allowed = torch.rand(32, vocab, generator=generator) < 0.1
    allowed[:, -1] = True  # half the rows masked down to a tenth of their tokens (and the last)
    probs[::2] *= allowed
    u = torch.rand(64, generator=generator)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(inverse_transform(probs, u), expected)
