"""Checks a ``CompletionRequest`` (from either front end) and resolves it into token ids and
sampling settings.

The limits, the defaults and the checks the engine shares live in ``pdserve.request_rules``;
what only the router can judge (which input was given, what the tokenizer makes of it) is
here. Every rejection is an ``InvalidRequest`` naming the offending field, so a client sees
exactly what to fix.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import (
    CHAT_ROLES,
    MAX_PROMPT_CHARS,
    InvalidRequest,
    check_best_of,
    check_message_count,
    check_priority,
    check_prompt_tokens,
    check_request_id,
    check_sampling,
    check_ttft_budget_ms,
    default_max_tokens,
)
from pdserve.router.request import ChatMessage, CompletionRequest, SamplingRequest
from pdserve.router.tokenizer import RouterTokenizer

__all__ = ["InvalidRequest", "ValidatedRequest", "validate"]


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    ttft_budget_ms: float | None = None
    arrival: float = field(default_factory=time.monotonic)
    best_of: int | None = None  # generate this many choices, return the sampling.n most likely

    @property
    def engine_sampling(self) -> SamplingParams:
        """What the workers run: with best_of, that many choices and the logprobs that rank them."""
        if self.best_of is None or self.best_of == self.sampling.n:
            return self.sampling
        return replace(self.sampling, n=self.best_of, logprobs=self.sampling.logprobs or 0)


def validate(req: CompletionRequest, tokenizer: RouterTokenizer) -> ValidatedRequest:
    """Request-level fields first, then the input, then sampling. Tokenizes: call it off the
    event loop."""
    request_id = req.request_id or uuid.uuid4().hex
    check_request_id(request_id)
    check_priority(req.priority)
    if req.ttft_budget_ms is not None:
        check_ttft_budget_ms(req.ttft_budget_ms)
    ids = _prompt_ids(req, tokenizer)
    sampling = _sampling(req.sampling, len(ids), tokenizer)
    if req.sampling.best_of is not None:
        check_best_of(req.sampling.best_of, sampling.n)
    return ValidatedRequest(request_id, ids, sampling, req.priority, req.ttft_budget_ms, best_of=req.sampling.best_of)


def _prompt_ids(req: CompletionRequest, tokenizer: RouterTokenizer) -> list[int]:
    given = [
        name
        for name, present in (
            ("prompt", req.prompt is not None),
            ("prompt_token_ids", len(req.prompt_token_ids) > 0),
            ("messages", len(req.messages) > 0),
        )
        if present
    ]
    if not given:
        raise InvalidRequest("prompt", "one of prompt, prompt_token_ids or messages is required")
    if len(given) > 1:
        raise InvalidRequest(
            given[1], f"give exactly one of prompt, prompt_token_ids, messages (got {' and '.join(given)})"
        )

    field = given[0]
    if field != "messages":
        for name, set_ in (
            ("add_generation_prompt", req.add_generation_prompt is not None),
            ("continue_final_message", req.continue_final_message),
        ):
            if set_:
                raise InvalidRequest(name, "applies to messages only")
    if field == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt", "must not be empty")
        if len(req.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt", f"{len(req.prompt)} characters exceed the limit of {MAX_PROMPT_CHARS}")
        _refuse_if_prefix_fills_context(req.prompt, tokenizer, field)
        ids = tokenizer.encode(req.prompt)
    elif field == "prompt_token_ids":
        ids = list(req.prompt_token_ids)
    else:
        messages = _messages(req.messages)
        if not tokenizer.has_chat_template:
            raise InvalidRequest("messages", "this model has no chat template; send a prompt instead")
        _refuse_if_prefix_fills_context("".join(m["content"] for m in messages), tokenizer, field)
        add_generation_prompt = _chat_turn(req, messages)
        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt, req.continue_final_message)
        except Exception as e:  # noqa: BLE001 - the model's own template refused these messages
            raise InvalidRequest("messages", f"the chat template cannot render them: {e}") from None
    check_prompt_tokens(ids, vocab_size=tokenizer.vocab_size, max_model_len=tokenizer.max_model_len, field=field)
    return ids


def _chat_turn(req: CompletionRequest, messages: list[dict[str, str]]) -> bool:
    """Whether the template opens the assistant's turn after ``messages`` (vLLM's rules; a
    continued final message closes nothing, so by default it opens nothing either)."""
    add = req.add_generation_prompt if req.add_generation_prompt is not None else not req.continue_final_message
    if req.continue_final_message:
        if add:
            raise InvalidRequest("continue_final_message", "cannot be combined with add_generation_prompt: true")
        if messages[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message", "the last message must be the assistant's, to continue")
    return add


def _refuse_if_prefix_fills_context(text: str, tokenizer: RouterTokenizer, field: str) -> None:
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


def _messages(messages: tuple[ChatMessage, ...]) -> list[dict[str, str]]:
    check_message_count(len(messages))
    total = 0
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role", f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        total += len(m.content)
        if total > MAX_PROMPT_CHARS:
            raise InvalidRequest("messages", f"content exceeds the limit of {MAX_PROMPT_CHARS} characters")
        out.append({"role": m.role, "content": m.content})
    if all(not m["content"] for m in out):
        raise InvalidRequest("messages", "every message is empty")
    return out


def _sampling(s: SamplingRequest, prompt_len: int, tokenizer: RouterTokenizer) -> SamplingParams:
    """Unset fields take the model's generation_config.json defaults, else ``SamplingParams``'
    (``max_tokens``: also bounded by the room left in the context); ``SamplingParams`` checks
    each value, then the model-bound rules."""
    given = {
        **tokenizer.sampling_defaults,
        **{
            name: getattr(s, name)
            for name in ("temperature", "top_p", "top_k", "seed", "n")
            if getattr(s, name) is not None
        },
    }
    max_tokens = s.max_tokens if s.max_tokens is not None else default_max_tokens(prompt_len, tokenizer.max_model_len)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        constraint=s.constraint,
        **given,
    )
    check_sampling(
        sampling, vocab_size=tokenizer.vocab_size, prompt_len=prompt_len, max_model_len=tokenizer.max_model_len
    )
    return sampling
