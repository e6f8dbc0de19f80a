"""Per-request sampling settings, checked on creation by the rules the router applies too."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.request_rules import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    GREEDY_BELOW,
    Constraint,
    check_sampling,
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Defaults follow vLLM/OpenAI: temperature 1, top_p 1, top_k 0 (off), 256 new tokens.

    temperature 0 (below ``GREEDY_BELOW``) means greedy. ``seed`` makes sampling reproducible: the random draw for the
    n-th generated token depends only on (seed, n), wherever that token is computed.
    ``n``: choices sampled from the one prompt (forked after its prefill; choice i > 0 draws
    its noise from ``choice_seed(seed, i)``). ``logprobs``/``prompt_logprobs``: report that
    many alternatives (0: the chosen token's alone) per generated/prompt token; None: off.
    ``constraint``: structured output (``engine.structured_output``).
    Out-of-range values raise ``InvalidRequest`` (a ValueError) naming the field.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def check_vocab(self, vocab_size: int) -> None:
        """The rules that need the model's vocabulary (``top_k``, ``stop_token_ids``)."""
        check_sampling(self, vocab_size=vocab_size)
