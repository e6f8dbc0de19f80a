"""Checks a public GenerateRequest and resolves it into token ids and sampling settings.

Every rejection names the offending field, so a client sees exactly what to fix.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import (
    DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pdserve.router.tokenizer import CHAT_ROLES, RouterTokenizer
from pdserve.v1 import pdserve_pb2 as pb

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 512
MAX_REQUEST_ID_CHARS = 128
PRIORITY_RANGE = (-100, 100)
MAX_TEMPERATURE = 100.0


class InvalidRequest(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    ttft_budget_ms: float | None = None
    arrival: float = field(default_factory=time.monotonic)


def validate(req: pb.GenerateRequest, tokenizer: RouterTokenizer) -> ValidatedRequest:
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    if not PRIORITY_RANGE[0] <= req.priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest("priority", f"{req.priority} is outside [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
    budget = None
    if req.HasField("ttft_budget_ms"):
        budget = req.ttft_budget_ms
        if not (budget > 0 and math.isfinite(budget)):
            raise InvalidRequest("ttft_budget_ms", f"must be a positive number of milliseconds, got {budget}")

    ids = _prompt_ids(req, tokenizer)
    sampling = _sampling(req.sampling, len(ids), tokenizer)
    return ValidatedRequest(request_id, ids, sampling, req.priority, budget)


def _prompt_ids(req: pb.GenerateRequest, tokenizer: RouterTokenizer) -> list[int]:
    given = [name for name, present in (
        ("prompt", req.HasField("prompt")),
        ("prompt_token_ids", len(req.prompt_token_ids) > 0),
        ("messages", len(req.messages) > 0),
    ) if present]
    if not given:
        raise InvalidRequest("prompt", "one of prompt, prompt_token_ids or messages is required")
    if len(given) > 1:
        raise InvalidRequest(given[1], f"give exactly one of prompt, prompt_token_ids, messages (got {' and '.join(given)})")

    if given[0] == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt", "must not be empty")
        if len(req.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt", f"{len(req.prompt)} characters exceed the limit of {MAX_PROMPT_CHARS}")
        _refuse_if_prefix_fills_context(req.prompt, tokenizer)
        ids = tokenizer.encode(req.prompt)
        field = "prompt"
    elif given[0] == "prompt_token_ids":
        ids = list(req.prompt_token_ids)
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequest("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
        field = "prompt_token_ids"
    else:
        messages = _messages(req.messages)
        if not tokenizer.has_chat_template:
            raise InvalidRequest("messages", "this model has no chat template; send a prompt instead")
        _refuse_if_prefix_fills_context("".join(m["content"] for m in messages), tokenizer, field="messages")
        try:
            ids = tokenizer.encode_chat(messages)
        except Exception as e:  # noqa: BLE001 - the model's own template refused these messages
            raise InvalidRequest("messages", f"the chat template cannot render them: {e}") from None
        field = "messages"

    if not ids:
        raise InvalidRequest(field, "the prompt encodes to no tokens")
    if len(ids) >= tokenizer.max_model_len:
        raise InvalidRequest(field, f"{len(ids)} tokens leave no room in the model's context of {tokenizer.max_model_len}")
    return ids


def _refuse_if_prefix_fills_context(text: str, tokenizer: RouterTokenizer, field: str = "prompt") -> None:
    """Tokenizing a huge text costs seconds; if a bounded prefix already overflows the
    context, the whole text does too (tokens of a prefix are a prefix of the tokens, up to
    the last few at the cut), so refuse without tokenizing the rest."""
    limit = tokenizer.max_model_len
    cut = limit * 8  # characters: plenty for any text that could fit
    if len(text) <= cut:
        return
    count = len(tokenizer.encode(text[:cut]))
    if count > limit + 16:
        raise InvalidRequest(field, f"more than {limit} tokens: no room in the model's context of {limit}")


def _messages(messages) -> list[dict[str, str]]:
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest("messages", f"{len(messages)} messages exceed the limit of {MAX_MESSAGES}")
    total = 0
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role", f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}")
        total += len(m.content)
        if total > MAX_PROMPT_CHARS:
            raise InvalidRequest("messages", f"content exceeds the limit of {MAX_PROMPT_CHARS} characters")
        out.append({"role": m.role, "content": m.content})
    if all(not m["content"] for m in out):
        raise InvalidRequest("messages", "every message is empty")
    return out


def _sampling(s: pb.SamplingParams, prompt_len: int, tokenizer: RouterTokenizer) -> SamplingParams:
    room = tokenizer.max_model_len - prompt_len
    if s.HasField("max_tokens"):
        max_tokens = s.max_tokens
        if max_tokens < 1:
            raise InvalidRequest("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise InvalidRequest(
                "sampling.max_tokens",
                f"{max_tokens} new tokens after a {prompt_len}-token prompt exceed the context of {tokenizer.max_model_len}",
            )
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE
    if not (0 <= temperature <= MAX_TEMPERATURE):  # also rejects NaN
        raise InvalidRequest("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if not 0 <= top_k <= tokenizer.vocab_size:
        raise InvalidRequest("sampling.top_k", f"must be in [0, {tokenizer.vocab_size}] (0 = off), got {top_k}")
    seed = s.seed if s.HasField("seed") else None
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InvalidRequest("sampling.seed", f"must be in [0, 2**63), got {seed}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"{len(s.stop)} stop strings exceed the limit of {MAX_STOP_STRINGS}")
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("sampling.stop_token_ids", f"{len(s.stop_token_ids)} ids exceed the limit of {MAX_STOP_TOKEN_IDS}")
    bad = next((t for t in s.stop_token_ids if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("sampling.stop_token_ids", f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
    )
