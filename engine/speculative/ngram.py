"""Prompt lookup (n-gram) proposals: no model, just the sequence's own tokens.

If the last n tokens (n from ``max_n`` down to ``min_n``; the longest match wins) occurred
before, in the prompt or the output so far, propose what followed their latest occurrence.
Extractive answers (quoting, correcting or reformatting the prompt) and repetitive output
hit often. Each sequence keeps an index from n-gram to where its latest occurrence ended,
updated with the new tokens only, so a lookup is O(max_n) whatever the length.
"""

from __future__ import annotations

from pdserve.engine.sequence import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.continuation: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.indexed = 0  # continuation indices < this are in the index

    def update(self, tokens: list[int]) -> None:
        # An n-gram ending right before index e has a continuation once tokens[e] exists.
        for end in range(max(self.indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.continuation[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (which ``update`` has seen), or none."""
        self.update(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.continuation.get(tuple(tokens[length - n :]))
            if start is None:
                continue
            # Past the end of the sequence the continuation repeats itself: period length - start.
            out: list[int] = []
            for j in range(k):
                at = start + j
                out.append(tokens[at] if at < length else out[at - length])
            return out
        return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[Sequence, NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self.indexes.get(seq)
        if index is None:
            index = self.indexes[seq] = NgramIndex(self.min_n, self.max_n)
        return index.propose(seq.token_ids, k)

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq, None)
