"""A generation request as a client sent it, whichever front end it came through.

The gRPC servicer fills it from a ``GenerateRequest``, the OpenAI API from a JSON body; one
validation (``router.validation``) then judges it. Nothing here is checked yet: ``None``
means "not given" (the documented default applies) and out-of-range values are the
validation's to refuse, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.request_rules import Constraint
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.wire import constraint_from_proto


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    @classmethod
    def from_proto(cls, s: pb.SamplingParams) -> "SamplingRequest":
        optional = {
            name: getattr(s, name)
            for name in (
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "n",
                "best_of",
                "logprobs",
                "prompt_logprobs",
            )
            if s.HasField(name)
        }
        return cls(
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            constraint=constraint_from_proto(s.structured_output),
            **optional,
        )


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """Exactly one of ``prompt``, ``prompt_token_ids`` or ``messages`` should be given."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    request_id: str = ""  # the client's, for logs and echo; empty: the router makes one up
    priority: int = 0
    ttft_budget_ms: float | None = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    add_generation_prompt: bool | None = None  # messages only (None: unless continue_final_message)
    continue_final_message: bool = False  # messages only

    @classmethod
    def from_proto(cls, req: pb.GenerateRequest) -> "CompletionRequest":
        return cls(
            prompt=req.prompt if req.HasField("prompt") else None,
            prompt_token_ids=tuple(req.prompt_token_ids),
            messages=tuple(ChatMessage(m.role, m.content) for m in req.messages),
            request_id=req.request_id,
            priority=req.priority,
            ttft_budget_ms=req.ttft_budget_ms if req.HasField("ttft_budget_ms") else None,
            sampling=SamplingRequest.from_proto(req.sampling),
            add_generation_prompt=req.add_generation_prompt if req.HasField("add_generation_prompt") else None,
            continue_final_message=req.continue_final_message,
        )
