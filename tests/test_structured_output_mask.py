"""The grammar mask of a row where the grammar allows nothing: only the stop tokens, every bit
of an int32 word included (bit 31 is the sign bit torch stores)."""

from __future__ import annotations

import torch

from pdserve.engine.structured_output import GrammarState


class NothingAllowed:
    """A matcher at a dead end: it allows no token."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0

    def is_terminated(self) -> bool:
        return False


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    words = bitmask[row].tolist()
    return [t for t in range(vocab) if (words[t >> 5] >> (t & 31)) & 1]


def test_a_dead_end_allows_only_the_stop_tokens():
    stops = [0, 31, 32, 95]
    state = GrammarState(NothingAllowed(), stops)
    bitmask = torch.full((2, 4), -1, dtype=torch.int32)  # row 0 as another row left it: all allowed
    state.fill(bitmask, 1)
    assert allowed(bitmask, 1, 128) == []
    state.end_here(bitmask, 1)
    assert allowed(bitmask, 1, 128) == stops and state.dead_end and state.constrains
    state.fill(bitmask, 0)  # later steps: the same, without asking the matcher again
    assert allowed(bitmask, 0, 128) == stops
    state.sync([7, 95])  # the stop token that ended it is not fed to the grammar
    assert state.accepted == 2 and not state.broken


def test_a_dead_end_with_no_stop_token_leaves_the_row_unconstrained():
    state = GrammarState(NothingAllowed(), [])
    bitmask = torch.zeros((1, 4), dtype=torch.int32)
    state.end_here(bitmask, 0)
    assert allowed(bitmask, 0, 128) == list(range(128)) and state.broken and not state.constrains
