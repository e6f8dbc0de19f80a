"""Prefill chunks sized so that a step that also decodes stays within the TPOT SLO.

A worker that mixes prompt chunks into decode steps (colocated, or a decode worker taking
short prompts under conditional disaggregation) stalls every running decode for as long as
the step takes. A fixed token budget (1024) lets one chunk stall them for seconds on a CPU;
instead, each step gets the largest chunk the profile says fits in the SLO next to the
decodes it already runs. Steps without decodes keep the full budget (nothing waits on them).
"""

from __future__ import annotations

import logging
from typing import Sequence

from pdserve.planner.profile import Overheads, Profile, StepCost

log = logging.getLogger(__name__)

MIN_CHUNK_TOKENS = 16  # a prompt always progresses, however full the decode batch


class ChunkSizer:
    """``Scheduler.prefill_token_limit``: decodes of this step -> most prompt tokens it may add."""

    def __init__(
        self,
        cost: StepCost,
        step_budget_ms: float,
        overheads: Overheads | None = None,
        min_tokens: int = MIN_CHUNK_TOKENS,
    ) -> None:
        if not step_budget_ms > 0:
            raise ValueError(f"the step budget must be > 0 ms, got {step_budget_ms}")
        self.cost = cost
        self.overheads = overheads or Overheads()
        self.step_budget_ms = step_budget_ms
        self.min_tokens = min_tokens

    def tokens(self, decodes: int, decode_context: int) -> int:
        # Serving costs per step and per streamed sequence come out of the same budget.
        budget = self.step_budget_ms - self.overheads.step_ms - self.overheads.seq_ms * (decodes + 1)
        return max(self.min_tokens, self.cost.max_prefill_tokens(decodes, decode_context, budget))

    def __call__(self, decodes: Sequence) -> int:
        """``decodes``: the step's ``ScheduledChunk``s of decoding sequences."""
        return self.tokens(len(decodes), sum(c.seq.num_tokens for c in decodes))


def sizer_for(profile: Profile, degree: int, tpot_ms: float) -> ChunkSizer:
    return ChunkSizer(profile.step_cost(degree), tpot_ms, profile.overheads)


def install(engine, profile_path: str, tpot_ms: float | None) -> ChunkSizer | None:
    """Makes ``engine``'s scheduler size prompt chunks from the profile (a worker's start-up
    hook); does nothing without a TPOT SLO. Raises ValueError/FileNotFoundError on a bad profile."""
    if not profile_path or tpot_ms is None:
        return None
    import torch

    profile = Profile.load(profile_path)
    profile.warn_if_other_model(engine.model_dir, profile_path)
    degree = engine.config.num_threads or torch.get_num_threads()
    if profile.parallel == "tensor_parallel":
        degree = getattr(engine.config, "tensor_parallel_size", 1)
    sizer = sizer_for(profile, degree, tpot_ms)
    engine.scheduler.prefill_token_limit = sizer
    log.info(
        "prefill chunks sized from %s for a %.0f ms TPOT: %d tokens next to 8 decodes of 512 tokens, %d alone in a step",
        profile_path,
        tpot_ms,
        sizer.tokens(8, 8 * 512),
        sizer.tokens(1, 512),
    )
    return sizer
