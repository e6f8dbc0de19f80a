"""One request's tokens and its place in the KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.choices import ChoiceGroup
    from pdserve.engine.kv_connector import KVReceive, KVSend
    from pdserve.engine.logprobs import TokenLogprob
    from pdserve.engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved; a prefill worker is filling them
    RUNNING = "running"
    SENDING_KV = "sending_kv"  # prefilled here; blocks held until the decode side acknowledges them
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why generation ended. Control outcomes (a prefill handed off, a request rejected, a
    transfer failed) are not finish reasons: see ``RequestOutput``."""

    STOP = "stop"  # EOS or a stop token id (stop strings are the router's)
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    priority: int = 0  # lower value = more important (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    # Tokens the request had generated before it came here (migration, recompute): they count
    # towards max_tokens and the sampler's seed index.
    num_prior_output_tokens: int = 0
    # The KV handoff: ship the prompt's K/V elsewhere (prefill side), or receive it from
    # elsewhere instead of computing it (decode side). At most one is set.
    kv_send: KVSend | None = None
    kv_receive: KVReceive | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full, computed blocks
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    admitted_at: int = -1  # scheduler step counter at admission (preemption picks the latest)
    start_deadline: float | None = None  # monotonic time by which the request must be admitted
    swapped_blocks: list[int] = field(default_factory=list)  # host slots while swapped out
    # API parity: prompt logprobs while the prompt runs (engine/logprobs.py), the grammar
    # state (engine/structured_output.py), and which of the request's n choices this is
    # (engine/choices.py; ``group`` is set once the choices are forked).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: GrammarState | None = None
    choice: int = 0
    group: ChoiceGroup | None = None
    ended_choices: frozenset[int] = frozenset()  # ended by the router before they forked

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens + self.num_prior_output_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token generated for the request, here or before a migration (the grammar's input)."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_output_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
