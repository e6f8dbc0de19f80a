"""Speculative decoding's parts without a model: n-gram lookup, the acceptance rules (with a
statistical check that the output keeps the target distribution), back-off, and the
scheduler's reservation of proposal slots. (With the real model: test_speculative.py.)"""

from __future__ import annotations

import random

import pytest
import torch
from goodness_of_fit import chi_square_p
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.backoff import FIRST_PAUSE, MAX_PAUSE, Backoff
from pdserve.engine.speculative.ngram import NgramIndex
from pdserve.engine.speculative.verify import accept_matching, rejection_sample

# -- n-gram lookup -------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 0, 6, 7]
    assert index.propose(tokens, 3) == [3, 4, 0]  # (6, 7) last occurred before 3, 4, 0


def test_longest_match_wins_over_a_later_shorter_one():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]
    # (1, 2, 3) matched at the start (-> 10, 11); (3,) alone matched later (-> 20, 21).
    assert index.propose(tokens, 2) == [10, 11]


def test_no_match_proposes_nothing_and_min_n_is_respected():
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([1, 2, 9, 2], 4) == []  # only a 1-gram repeats
    assert NgramIndex(1, 3).propose([1, 2, 9, 2], 4) == [9, 2, 9, 2]


def test_a_repetition_loop_is_continued_past_the_end():
    index = NgramIndex(2, 4)
    tokens = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    assert index.propose(tokens, 7) == [3, 1, 2, 3, 1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 6),
)
def test_incremental_index_equals_a_fresh_search(tokens, cuts, min_n, extra, k):
    """Updating the index as tokens arrive gives what a brute-force search of the whole sequence gives."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    end = 0
    for cut in [*cuts, len(tokens)]:
        end = min(len(tokens), end + cut)
        prefix = tokens[:end]
        assert index.propose(prefix, k) == _brute_force(prefix, min_n, max_n, k)


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                out = []
                for j in range(k):
                    at = start + n + j
                    out.append(tokens[at] if at < len(tokens) else out[at - len(tokens)])
                return out
    return []


# -- acceptance --------------------------------------------------------------------------------------


def test_matching_keeps_proposals_up_to_the_first_disagreement():
    assert accept_matching([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, then the model's next token
    assert accept_matching([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's own token replaces the first miss
    assert accept_matching([4, 5, 6], [1, 5, 6, 7]) == [1]


def _distributions(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft rows that differ a lot, with tokens only one of them can produce."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, vocab, generator=g, dtype=torch.float64) ** 2
    p[:, 0] = 0.0  # only the draft proposes token 0: always rejected
    p /= p.sum(-1, keepdim=True)
    q = p + torch.rand(rows, vocab, generator=g, dtype=torch.float64) ** 2 / vocab
    q[:, 1] = 0.0  # only the target has token 1: reachable through the residual alone
    return p, q / q.sum(-1, keepdim=True)


def test_rejection_sampling_keeps_the_target_distribution_at_every_position():
    """Each emitted token, at every position of the verified chunk, is distributed as the target
    row of that position (chi-square, a fixed seed: no flakiness)."""
    vocab, k, trials = 6, 3, 12_000
    p, q = _distributions(vocab, k + 1, seed=1)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(k + 1, vocab, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        bonus = int(torch.multinomial(p[k], 1, generator=g))
        out = rejection_sample(draft, q, p, bonus, generator=g)
        accepted += len(out) - 1
        for i, token in enumerate(out):
            counts[i, token] += 1
    for i in range(k + 1):
        assert counts[i].sum() > 500, "too few samples reach this position to test it"
        assert chi_square_p(counts[i], p[i]) > 1e-3, f"position {i}: {counts[i].tolist()} vs {p[i].tolist()}"
    # Acceptance is the classic bound: sum(min(p, q)) per proposal.
    expected_first = float(torch.minimum(p[0], q[0]).sum())
    first_kept = counts[1].sum() / trials
    assert abs(first_kept - expected_first) < 0.02


def test_matching_a_coupled_draft_emits_the_targets_own_samples():
    """A draft that draws argmax(q / E) with the target's noise E: every emitted token is the
    target sampler's draw, so the stream is distributed as the target, and the draft is right
    about as often as the coupling allows."""
    vocab, k, trials = 6, 3, 2_500
    p, q = _distributions(vocab, k + 1, seed=3)
    rows = trials * (k + 1)  # trial t, position i: token index t * (k + 1) + i (independent draws)
    target = (
        Sampler(torch.device("cpu"))(
            p.float().log().repeat(trials, 1), [SamplingParams(temperature=1.0, seed=11)] * rows, list(range(rows))
        )
        .view(trials, k + 1)
        .tolist()
    )
    noise = torch.stack([_seeded_noise(11, i, vocab) for i in range(rows)]).view(trials, k + 1, vocab)
    drafts = (q.float()[None] / noise).argmax(-1)[:, :k].tolist()
    counts = torch.zeros(vocab, dtype=torch.float64)
    hits = 0
    for draft, sampled in zip(drafts, target):
        out = accept_matching(draft, sampled)
        assert out == sampled[: len(out)]
        hits += len(out) - 1
        counts[out[0]] += 1
    assert chi_square_p(counts, p[0]) > 1e-3
    assert hits > 0.1 * trials * k


def _seeded_noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    from pdserve.engine.sampler import seeded_noise

    return seeded_noise([(seed, index)], vocab)[0]


# -- back-off ---------------------------------------------------------------------------------------


def test_backoff_shortens_then_pauses_with_doubling_pauses_and_recovers():
    backoff = Backoff(max_tokens=5)
    record = backoff.new()
    assert backoff.lookahead(record) == 3  # a new sequence starts at 3
    for _ in range(4):
        backoff.update(record, backoff.lookahead(record))  # everything kept: proposals grow to K
    assert backoff.lookahead(record) == 5
    pauses = []
    for _ in range(6):  # nothing kept, again and again
        while backoff.lookahead(record) > 0:
            backoff.update(record, 0)
        pause = 1
        while backoff.lookahead(record) == 0:
            pause += 1
        pauses.append(pause)
        backoff.update(record, 0)  # the probe after the pause fails too
    assert pauses[0] == FIRST_PAUSE and all(b >= a for a, b in zip(pauses, pauses[1:])) and pauses[-1] > 4 * FIRST_PAUSE
    assert max(pauses) <= MAX_PAUSE
    while backoff.lookahead(record) == 0:
        pass
    backoff.update(record, 2)  # a probe that keeps proposals ends the back-off
    assert record.failures == 0 and backoff.lookahead(record) > 0


def test_backoff_costs_at_most_a_few_percent_of_steps_on_unpredictable_text():
    backoff = Backoff(max_tokens=4)
    record = backoff.new()
    verifications = sum(1 for _ in range(2000) if backoff.lookahead(record) and (backoff.update(record, 0) or True))
    assert verifications / 2000 < 0.02


# -- scheduling proposal slots -------------------------------------------------------------------------

BS = 4


def _seq(rid: str, n: int) -> Sequence:
    s = Sequence(rid, list(range(100, 100 + n)), n, SamplingParams(max_tokens=50))
    return s


def _decoding(sched: Scheduler, *seqs: Sequence) -> None:
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        chunk.seq.token_ids.append(7)


def test_lookahead_slots_come_from_free_blocks_within_the_budget():
    blocks = BlockManager(8, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks)
    a, b = _seq("a", 4), _seq("b", 4)
    _decoding(sched, a, b)  # 5 tokens each: 2 blocks each, 4 free
    sched.lookahead = lambda s: 6
    out = sched.schedule()
    assert [c.lookahead for c in out.decodes] == [6, 6]
    assert len(a.block_table) == len(b.block_table) == 3  # 5 + 6 tokens: 3 blocks
    blocks.trim(a, a.num_tokens)
    assert len(a.block_table) == 2 and blocks.num_free == 3


def test_lookahead_never_preempts_and_shrinks_to_what_fits():
    blocks = BlockManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks)
    a, b = _seq("a", 4), _seq("b", 4)
    _decoding(sched, a, b)  # 5 tokens each: 2 blocks each, none free
    sched.lookahead = lambda s: 16
    out = sched.schedule()
    assert [c.lookahead for c in out.decodes] == [3, 3]  # only the slack of their own second blocks
    # Had "a" reserved its proposals before "b" its next token, "b" would have been preempted.
    assert not out.preempted and sched.num_preemptions == 0 and blocks.num_free == 0


def test_lookahead_is_bounded_by_the_token_budget():
    blocks = BlockManager(32, BS, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), blocks)
    seqs = [_seq(str(i), 2) for i in range(3)]
    _decoding(sched, *seqs)
    sched.lookahead = lambda s: 4
    out = sched.schedule()
    assert sum(1 + c.lookahead for c in out.decodes) == 8  # 3 decodes + 5 proposals
    assert [c.lookahead for c in out.decodes] == [4, 1, 0]


def test_trim_refuses_to_drop_a_hashed_block():
    blocks = BlockManager(8, BS, enable_prefix_caching=True)
    s = _seq("a", 8)
    blocks.allocate(s, 9, [])
    s.num_computed_tokens = 8
    blocks.commit_full_blocks(s)
    with pytest.raises(AssertionError):
        blocks.trim(s, 4)


def test_rejection_sampling_without_generator_uses_the_global_rng():
    random.seed(0)
    torch.manual_seed(0)
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0]])
    assert rejection_sample([0], q, p, bonus=0) == [1]  # q proposes what p never emits: replaced from the residual


def test_a_proposal_its_own_draft_gives_no_mass_is_rejected():
    """q(d) = 0 means d was not drawn from q; keeping it would emit a token p never gives."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    for seed in range(20):
        out = rejection_sample([2], q, p, bonus=0, generator=torch.Generator().manual_seed(seed))
        assert len(out) == 1 and out[0] in (0, 1)


def test_a_prompt_handing_off_its_kv_carries_no_proposals():
    """Its one first token goes to the decode worker with the K/V; proposals accepted on the
    prefill side would be tokens the handoff drops."""
    from pdserve.engine.kv_connector import KVSend
    from pdserve.engine.speculative.speculator import speculates

    plain = Sequence("a", [1, 2, 3], 3, SamplingParams(max_tokens=8))
    handed_off = Sequence("b", [1, 2, 3], 3, SamplingParams(max_tokens=8), kv_send=KVSend(object()))
    assert speculates(plain) and not speculates(handed_off)
