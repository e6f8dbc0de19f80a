"""The block manager alone (no model): reference counts, the free list as LRU eviction order,
chained prefix hashes, shared prefixes, and the rule that a computed prompt keeps one token."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager, block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Marks ``s``'s prompt as computed and registers its full blocks in the prefix cache."""
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return s


def test_chained_hashes_depend_on_every_earlier_token():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert block_hashes([1, 2, 3], BS) == []  # no full block


def test_allocate_free_and_reuse_a_cached_prefix():
    bm = BlockManager(8, BS)
    a = seq(list(range(10)), "a")
    bm.allocate(a, a.num_tokens, bm.usable_hits(a))
    assert len(a.block_table) == 3 and bm.num_free == 5 and a.num_cached_tokens == 0
    computed(bm, a)
    assert len(bm.cached) == 2  # two full blocks
    bm.free(a)
    assert bm.num_free == 8 and len(bm.cached) == 2  # freed blocks stay findable

    b = seq(list(range(9)) + [99], "b")  # shares the first two blocks
    hits = bm.usable_hits(b)
    assert hits == [bm.cached[h] for h in block_hashes(list(range(8)), BS)]
    bm.allocate(b, b.num_tokens, hits)
    assert b.block_table[:2] == hits and b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.prefix_hits == 2


def test_a_computed_prompt_keeps_its_last_token_but_a_received_one_may_hit_in_full():
    bm = BlockManager(8, BS)
    computed(bm, _allocated(bm, seq(list(range(8)), "warm")))
    same = seq(list(range(8)), "again")
    assert len(bm.usable_hits(same)) == 1  # the last token must run to produce logits
    assert len(bm.usable_hits(same, computes_logits=False)) == 2


def test_lru_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(3, BS)
    a, b = seq([1, 2, 3, 4], "a"), seq([5, 6, 7, 8], "b")
    for s in (a, b):
        bm.allocate(s, s.num_tokens, [])
        computed(bm, s)
    bm.free(a)
    bm.free(b)
    version = bm.cache_version
    c = seq([9, 9, 9, 9, 9, 9, 9, 9], "c")  # needs two blocks: the free one, then a's
    bm.allocate(c, c.num_tokens, [])
    assert bm.evictions == 1 and bm.cache_version > version
    assert bm.cached_prefix_blocks([1, 2, 3, 4]) == []  # a's block was reused
    assert bm.cached_prefix_blocks([5, 6, 7, 8]) != []  # b's is still cached


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(4, BS)
    a = computed(bm, _allocated(bm, seq([1, 2, 3, 4, 5], "a")))
    b = _allocated(bm, seq([1, 2, 3, 4, 6], "b"))
    shared = a.block_table[0]
    assert b.block_table[0] == shared and bm.blocks[shared].ref_count == 2
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm._free_ids
    bm.free(b)
    assert bm.num_free == 4
    with pytest.raises(AssertionError, match="double free"):
        bm.free_blocks([shared])


def test_allocation_that_does_not_fit_raises_and_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq(list(range(12)))
    assert not bm.can_allocate(s, s.num_tokens, [])
    with pytest.raises(MemoryError):
        bm.allocate(s, s.num_tokens, [])
    assert bm.num_free == 2 and not s.block_table


def test_ensure_capacity_grows_one_block_at_a_time():
    bm = BlockManager(3, BS)
    s = _allocated(bm, seq([1, 2, 3, 4]))
    assert bm.ensure_capacity(s, 5) and len(s.block_table) == 2
    assert bm.ensure_capacity(s, 8) and len(s.block_table) == 2
    assert bm.ensure_capacity(s, 12) and len(s.block_table) == 3
    assert not bm.ensure_capacity(s, 13)


def _allocated(bm: BlockManager, s: Sequence) -> Sequence:
    bm.allocate(s, s.num_tokens, bm.usable_hits(s))
    return s
