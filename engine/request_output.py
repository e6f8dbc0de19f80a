"""What the engine hands back for a request: new tokens, and the outcomes that are not tokens
(a KV reservation, an acknowledged KV handoff, a rejection, a failed transfer)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.sequence import FinishReason


class RequestRejected(Exception):
    """The request could not start in time (its TTFT budget, or the wait for KV blocks)."""


class TransferFailed(Exception):
    """The request's KV handoff failed; ``corrupted``: the K/V arrived damaged."""

    def __init__(self, reason: str, corrupted: bool = False) -> None:
        super().__init__(reason)
        self.corrupted = corrupted


@dataclass(frozen=True, slots=True)
class KVReservation:
    """Decode side: blocks reserved for a request whose prompt K/V a prefill worker will send."""

    transfer_id: int
    block_ids: list[int]
    num_tokens: int  # tokens whose K/V must arrive (the prompt)
    num_cached_tokens: int  # leading tokens already here (prefix cache): not sent


@dataclass(frozen=True, slots=True)
class KVSent:
    """Prefill side: the decode side acknowledged the request's K/V (checksums verified)."""

    transport: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill side, n > 1: one choice's first token (``finish_reason``: it already ends that choice)."""

    token_id: int
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool = False  # the request's last output (a finish reason, a handoff acknowledged, an error)
    kv: KVReservation | KVSent | None = None
    error: Exception | None = None  # RequestRejected or TransferFailed: the request ends with it
    # API parity. ``finish_reason`` ends choice ``index``; ``finished`` the whole request.
    index: int = 0  # which of the request's choices (n > 1) the tokens belong to
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the request's first token, when asked for
    first_tokens: list[FirstToken] | None = None  # prefill side, n > 1: every choice's first token

    @classmethod
    def failed(cls, request_id: str, error: Exception, num_prompt_tokens: int = 0) -> "RequestOutput":
        return cls(request_id, [], None, num_prompt_tokens, 0, finished=True, error=error)
