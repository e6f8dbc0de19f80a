"""KV block allocation: reference counts, a free list, and automatic prefix caching.

A full block is identified by a chained hash of its token ids and its parent block's hash,
so equal hashes mean equal prefixes. Freed blocks keep their hash and stay findable until
they are reused, least recently freed first: the free list is the LRU eviction order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.engine.sequence import Sequence
from pdserve.prefix_hash import NO_HASH, block_hashes, chain_hash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = field(default=())


@dataclass(slots=True)
class BlockStats:
    num_blocks: int
    num_free: int
    num_cached: int  # hashed blocks, in use or free
    prefix_queries: int  # full prompt blocks looked up
    prefix_hits: int
    evictions: int  # cached blocks reused for other content


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.cache_version = 0  # changes whenever ``cached`` does
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> BlockStats:
        return BlockStats(
            self.num_blocks, self.num_free, len(self.cached), self.prefix_queries, self.prefix_hits, self.evictions
        )

    def cached_prefix_blocks(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids`` (full blocks only)."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for i, h in enumerate(block_hashes(token_ids, self.block_size)):
            block_id = self.cached.get(h)
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:  # miss, or a hash collision
                break
            found.append(block_id)
        return found

    # -- allocation -----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int]) -> bool:
        """``hits``: ``usable_hits(seq, ...)``, looked up once by the caller."""
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hits) <= self.num_free - reusable_free

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int]) -> None:
        """Gives ``seq`` blocks for its first ``num_tokens`` tokens, sharing the cached prefix
        blocks ``hits`` (``usable_hits(seq, ...)``); the rest are fresh."""
        assert not seq.block_table, "sequence already holds blocks"
        if not self.can_allocate(seq, num_tokens, hits):
            raise MemoryError("not enough free KV blocks")
        self.prefix_queries += seq.num_tokens // self.block_size
        self.prefix_hits += len(hits)
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        for _ in range(self.blocks_needed(num_tokens) - len(hits)):
            seq.block_table.append(self._take_free())
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def allocate_blocks_raw(self, count: int) -> list[int]:
        """``count`` fresh blocks (caller checked ``num_free``)."""
        return [self._take_free() for _ in range(count)]

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows ``seq``'s block table to hold ``num_tokens``; False if blocks ran out."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Gives ``child`` (the same computed prefix as ``parent``, its own next token) the
        parent's full computed blocks, shared, and fresh blocks for the rest. Returns the
        (source, destination) block copies the caller must make (the parent's partial last
        block: copy-on-write), or None when too few blocks are free."""
        assert not child.block_table, "sequence already holds blocks"
        computed = parent.num_computed_tokens
        full = computed // self.block_size
        fresh = self.blocks_needed(child.num_tokens) - full
        if fresh > self.num_free:
            return None
        for block_id in parent.block_table[:full]:
            self._ref(block_id)
        child.block_table = parent.block_table[:full] + [self._take_free() for _ in range(fresh)]
        child.block_hashes = parent.block_hashes[:full]
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        if computed % self.block_size:
            return [(parent.block_table[full], child.block_table[full])]
        return []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Frees ``seq``'s blocks past the first ``num_tokens`` tokens (slots reserved for
        speculative tokens that were rejected). Only unhashed blocks can be past them: a block
        is hashed once all of its tokens are computed and accepted."""
        keep = self.blocks_needed(num_tokens)
        if keep < len(seq.block_table):
            assert len(seq.block_hashes) <= keep, "trimming a hashed block"
            self.free_blocks(seq.block_table[keep:])
            del seq.block_table[keep:]

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Registers the hashes of ``seq``'s blocks that have become full and computed."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(list(tokens), parent)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH and h not in self.cached:  # same content twice: keep the first
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
                self.cache_version += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        # Reversed, so a sequence's tail (the least shareable part) is evicted first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # -- internals ------------------------------------------------------------------------
    def usable_hits(self, seq: Sequence, computes_logits: bool = True) -> list[int]:
        """The cached blocks ``allocate`` would share for ``seq``'s prompt (no side effects).
        ``computes_logits``: the prompt runs through the model here, so at least its last
        token must be computed (a prompt whose K/V arrive from elsewhere may hit in full).
        A prompt whose logprobs are wanted is computed in full: a cached block holds K/V, not
        the logits its tokens' logprobs come from (``engine.logprobs``)."""
        if computes_logits and seq.prompt_logprobs is not None:
            return []
        hits = self.cached_prefix_blocks(seq.token_ids)
        while computes_logits and hits and len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        return hits

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_ids[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self._free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:
            del self.cached[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
            self.evictions += 1
            self.cache_version += 1
        block.ref_count = 1
        return block_id
