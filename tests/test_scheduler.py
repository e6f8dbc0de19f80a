"""The scheduler alone (no model): admission order, the token budget, chunking, preemption by
swap and by recompute, start deadlines, and reservations for K/V that arrive from a prefill
worker. Steps are simulated: a scheduled chunk is marked computed and decodes get a token."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import KVCache, KVLayout
from pdserve.engine.kv_connector import KVReceive
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.swap import SwapSpace

BS = 4


def make(num_blocks=16, max_seqs=8, budget=64, chunked=True, swap_blocks=0) -> Scheduler:
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    swap = None
    if swap_blocks:
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)
        swap = SwapSpace(KVCache(layout, num_blocks, torch.device("cpu")), swap_blocks)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), blocks, swap)


def seq(rid: str, n: int, priority: int = 0, remote: bool = False) -> Sequence:
    s = Sequence(rid, list(range(100, 100 + n)), n, SamplingParams(max_tokens=50), priority=priority)
    if remote:
        s.kv_receive = KVReceive(receiver=None)
    return s


def complete(out: SchedulerOutput) -> None:
    """What the engine does after the forward: mark chunks computed, sample a token where due."""
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        if chunk.completes:
            chunk.seq.token_ids.append(7)


def test_priority_then_arrival_order_and_the_token_budget():
    sched = make(budget=10)
    for s in (seq("late-important", 6, priority=-1), seq("a", 4), seq("b", 4)):
        sched.add(s)
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.prefills] == [("late-important", 6), ("a", 4)]
    assert [s.request_id for s in sched.waiting] == ["b"]
    complete(out)
    out = sched.schedule()  # two decodes, then b's prompt
    assert len(out.decodes) == 2 and [c.seq.request_id for c in out.prefills] == ["b"]


def test_chunked_prefill_splits_a_long_prompt_and_unchunked_runs_it_alone():
    sched = make(budget=8)
    sched.add(seq("long", 20))
    sizes = []
    for _ in range(3):
        out = sched.schedule()
        sizes.append(out.prefills[0].num_tokens)
        complete(out)
    assert sizes == [8, 8, 4]

    sched = make(budget=8, chunked=False)
    sched.add(seq("long", 20))
    out = sched.schedule()
    assert out.prefills[0].num_tokens == 20  # over the budget, but alone rather than never


def test_recompute_preemption_picks_the_least_important_latest_admitted():
    sched = make(num_blocks=4, budget=64)
    keep, victim = seq("keep", 8, priority=0), seq("victim", 7, priority=1)
    sched.add(keep)
    sched.add(victim)
    complete(sched.schedule())  # keep: 8 tokens (2 blocks) + 1; victim: 7 tokens (2 blocks) + 1
    out = sched.schedule()  # keep needs a third block: none free, so the victim goes
    assert out.preempted == [victim] and sched.num_preemptions == 1
    assert victim.status is SequenceStatus.WAITING and not victim.block_table and victim.num_computed_tokens == 0
    assert [c.seq for c in out.decodes] == [keep]


def test_swap_preemption_of_a_handed_off_request_with_a_block_aligned_prompt():
    """Issue 13, defect 1: a handed-off request holds blocks for prompt + 1 tokens. With a
    prompt that fills its blocks exactly and a preemption before its first decode step, the
    swap-out took every block of the table and the swap-in allocated one fewer: a shape
    mismatch failed the whole step and leaked the swap-in blocks."""
    sched = make(num_blocks=6, budget=64, swap_blocks=8)
    cache = sched.swap.cache
    old = seq("old", 8)
    sched.add(old)
    complete(sched.schedule())  # old: 8 prompt tokens in 2 blocks, first token sampled
    complete(sched.schedule())  # old decodes: 3 blocks
    handed = seq("handed-off", 8, remote=True)
    sched.add(handed)
    out = sched.schedule()
    assert out.reserved == [handed] and len(handed.block_table) == 3  # blocks_needed(8 + 1): the pool is full
    complete(out)
    while old.num_tokens < 13:  # old's next step needs a fourth block
        complete(sched.schedule())
    for b, block in enumerate(handed.block_table):  # the K/V a prefill worker would have written
        cache.tensor[:, block] = float(b + 1)
    expected = cache.tensor[:, handed.block_table[:2]].clone()
    handed.token_ids.append(7)
    handed.num_computed_tokens = 8
    sched.admit_landed(handed)

    out = sched.schedule()  # old grows first; the latest admitted, handed, is the victim
    assert out.preempted == [handed] and [c.seq for c in out.decodes] == [old]
    # Only the blocks holding K/V went out, and they fit again at once (the old code crashed here).
    assert sched.swap.swapped_out == 2 and sched.swap.swapped_in == 2
    assert handed.status is SequenceStatus.RUNNING and len(handed.block_table) == 2
    assert torch.equal(cache.tensor[:, handed.block_table], expected)
    complete(out)
    sched.remove(old)  # old finishes; handed decodes on
    sched.blocks.free(old)
    for _ in range(2):
        out = sched.schedule()
        assert [c.seq for c in out.decodes] == [handed]
        complete(out)
    sched.remove(handed)
    sched.blocks.free(handed)
    assert sched.blocks.num_free == 6 and sched.swap.num_free == 8


def test_a_handed_off_request_preempted_by_recompute_prefills_here():
    """Its K/V landed once; dropped, they are recomputed locally, not awaited again from a
    prefill worker (none would send them: the request waited out its lease, then migrated)."""
    sched = make(num_blocks=6, budget=64)
    old = seq("old", 8)
    sched.add(old)
    complete(sched.schedule())
    complete(sched.schedule())  # old: 3 blocks
    handed = seq("handed-off", 8, remote=True)
    sched.add(handed)
    out = sched.schedule()
    assert out.reserved == [handed]
    handed.token_ids.append(7)
    handed.num_computed_tokens = 8
    sched.admit_landed(handed)
    while True:  # old grows until it needs handed's blocks
        out = sched.schedule()
        if out.preempted:
            break
        complete(out)
    assert out.preempted == [handed] and handed.status is SequenceStatus.WAITING and handed.kv_receive is None
    complete(out)
    sched.remove(old)
    sched.blocks.free(old)
    out = sched.schedule()
    assert not out.reserved and [c.seq for c in out.prefills] == [handed]
    assert out.prefills[0].num_tokens == handed.num_tokens  # prompt and the first token, recomputed here


def test_a_failed_swap_in_leaks_nothing(monkeypatch):
    sched = make(num_blocks=4, swap_blocks=4)
    s = seq("s", 5)
    sched.add(s)
    complete(sched.schedule())
    sched.preempt(s)
    assert s in sched.swapped

    def broken(host, device):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(sched.swap, "swap_in", broken)
    with pytest.raises(RuntimeError):
        sched.schedule()
    assert sched.blocks.num_free == 4 and sched.swap.num_free == 4


def test_remote_kv_reservation_takes_no_token_budget_and_keeps_priority_order():
    sched = make(num_blocks=6, budget=4)
    sched.add(seq("local", 4))
    sched.add(seq("remote", 12, remote=True))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["local"]
    assert [s.request_id for s in out.reserved] == ["remote"]
    remote = out.reserved[0]
    assert remote.status is SequenceStatus.WAITING_FOR_REMOTE_KV and len(remote.block_table) == 4  # 13 tokens
    assert remote not in sched.running and sched.num_unfinished == 2
    complete(out)

    # The head of the queue waits for blocks; nothing behind it overtakes.
    big, small = seq("big", 20, remote=True), seq("small", 2)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert not out.reserved and not out.prefills and sched.waiting == [big, small]


def test_reservations_count_towards_the_running_batch():
    sched = make(num_blocks=16, max_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 4, remote=True))
    out = sched.schedule()
    assert len(out.reserved) == 2 and len(sched.waiting) == 1


def test_waiting_requests_past_their_start_deadline_are_rejected():
    sched = make(num_blocks=2)
    blocker = seq("blocker", 8)
    sched.add(blocker)
    sched.schedule()
    late = seq("late", 4, remote=True)
    late.start_deadline = time.monotonic() - 1
    sched.add(late)
    assert sched.next_deadline() == late.start_deadline
    out = sched.schedule()
    assert out.expired == [late] and sched.num_rejected == 1 and not sched.waiting
