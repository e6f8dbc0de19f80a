"""Chained block hashes: what identifies a prompt prefix, for the engine's prefix cache and
the router's KV-aware routing alike (one definition, so both always agree).

A full block's hash covers its token ids and its parent block's hash, so equal hashes mean
equal prefixes.
"""

from __future__ import annotations

import numpy as np
import xxhash

NO_HASH = -1


def chain_hash(token_ids: list[int], parent: int) -> int:
    """The hash of a block given its parent's (``NO_HASH`` for the first block)."""
    seed = 0 if parent == NO_HASH else parent
    return xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype=np.int64).tobytes(), seed=seed)


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes, parent = [], NO_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(token_ids[start : start + block_size], parent)
        hashes.append(parent)
    return hashes
