"""One OpenAI request on its way through the API: its id and its response shapes, whole or
streamed, for every choice (``n``), with log probabilities, vLLM's prompt logprobs and the
echoed prompt when asked."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from pdserve.router.completions import Chunk
from pdserve.router.openai_logprobs import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    merge_blocks,
    prompt_logprobs,
)
from pdserve.router.openai_protocol import openai_finish_reason, sse, usage_body
from pdserve.router.validation import ValidatedRequest
from pdserve.v1 import pdserve_pb2 as pb


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far (non-streaming: all of it)."""

    text: list[str] = field(default_factory=list)
    logprob_blocks: list[dict[str, Any]] = field(default_factory=list)  # completions
    content_logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat
    finish_reason: str | None = None
    offsets: CompletionLogprobs | None = None


class Job:
    def __init__(
        self,
        model_name: str,
        chat: bool,
        validated: ValidatedRequest,
        include_usage: bool,
        texts: TokenTexts,
        echo: bool = False,
        prompt_text: str = "",
        show_prompt_logprobs: bool = False,
        echo_only: bool = False,
    ) -> None:
        """``show_prompt_logprobs``: the client asked for vLLM's ``prompt_logprobs`` (answered
        whole only; echo with logprobs asks the engine for them too, for its own block).
        ``echo_only``: echo with max_tokens 0 (scoring a text): the prompt, and nothing generated;
        the one token the engine drew to get the prompt's logprobs is not shown."""
        self.model_name = model_name
        self.chat = chat
        self.validated = validated
        self.id = validated.request_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.texts = texts
        self.echo = echo and not chat
        self.prompt_text = prompt_text
        self.logprobs = validated.sampling.logprobs is not None
        self.prompt_logprobs: list[pb.TokenLogprob] | None = None  # arrive with choice 0's first chunk
        self.show_prompt_logprobs = show_prompt_logprobs
        self.echo_only = echo_only and self.echo
        self.choices: dict[int, _Choice] = {}

    def _shown(self, chunk: Chunk) -> Chunk:
        if not self.echo_only:
            return chunk
        usage = chunk.usage and replace(chunk.usage, completion_tokens=0)
        return replace(
            chunk, token_ids=[], text="", logprobs=[], finish_reason=chunk.finish_reason and "length", usage=usage
        )

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": None,
        }

    def _take(self, chunk: Chunk) -> tuple[_Choice, bool, str, dict[str, Any] | None]:
        """Records ``chunk`` under its choice; returns (choice, first chunk of it, text to add,
        its completions logprobs block)."""
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        first = chunk.index not in self.choices
        choice = self.choices.setdefault(chunk.index, _Choice())
        text, block = chunk.text, None
        if first and self.echo:
            text = self.prompt_text + text
        if not self.chat and (self.logprobs or (first and self.echo and self.prompt_logprobs is not None)):
            if first:
                choice.offsets = CompletionLogprobs(self.texts)
            blocks = []
            if first and self.echo and self.prompt_logprobs is not None:
                prompt = self.validated.prompt_token_ids
                blocks.append(choice.offsets.block(prompt, [None, *self.prompt_logprobs], echoed=self.prompt_text))
                choice.offsets.restart_at(len(self.prompt_text))  # the completion follows the echoed text
            if self.logprobs:
                blocks.append(choice.offsets.block(chunk.token_ids, chunk.logprobs))
            block = merge_blocks(blocks)
        choice.text.append(text)
        if block is not None:
            choice.logprob_blocks.append(block)
        if self.chat and self.logprobs:
            choice.content_logprobs += chat_logprobs(self.texts, chunk.token_ids, chunk.logprobs)
        choice.finish_reason = openai_finish_reason(chunk.finish_reason) or choice.finish_reason
        return choice, first, text, block

    # -- non-streaming -------------------------------------------------------------------------
    def full(self, chunks: list[Chunk]) -> dict[str, Any]:
        chunks = [self._shown(chunk) for chunk in chunks]
        for chunk in chunks:
            self._take(chunk)
        usage = usage_body(chunks[-1].usage if chunks else None)
        shown = None
        if self.show_prompt_logprobs:
            shown = prompt_logprobs(self.texts, self.validated.prompt_token_ids, self.prompt_logprobs or [])
        out = []
        for index in sorted(self.choices):
            c = self.choices[index]
            if self.chat:
                logprobs = {"content": c.content_logprobs, "refusal": None} if self.logprobs else None
                out.append(
                    {
                        "index": index,
                        "message": {
                            "role": "assistant",
                            "content": "".join(c.text),
                            "refusal": None,
                            "annotations": [],
                        },
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {
                        "index": index,
                        "text": "".join(c.text),
                        "logprobs": merge_blocks(c.logprob_blocks),
                        "finish_reason": c.finish_reason,
                        **({"prompt_logprobs": shown} if shown is not None else {}),
                    }
                )
        kind = "chat.completion" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": out, "usage": usage}
        if self.chat and shown is not None:
            body["prompt_logprobs"] = shown  # vLLM: once per chat response
        return body

    # -- streaming -----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage=None, last: bool = False) -> bytes:
        payload = {**self._head(self.object), "choices": choices}
        if self.include_usage:
            payload["usage"] = usage_body(usage) if last else None
        return sse(payload)

    def events(self, chunk: Chunk) -> Iterable[bytes]:
        chunk = self._shown(chunk)
        finish = openai_finish_reason(chunk.finish_reason)
        tokens_before = len(self.choices[chunk.index].content_logprobs) if chunk.index in self.choices else 0
        choice, first, text, block = self._take(chunk)
        i = chunk.index
        if self.chat:
            if first:
                yield self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            new_logprobs = choice.content_logprobs[tokens_before:] if self.logprobs else None
            if text or new_logprobs:
                logprobs = {"content": new_logprobs, "refusal": None} if new_logprobs else None
                yield self._chunk(
                    [{"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}]
                )
            if finish:
                yield self._chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}])
        elif text or finish or block:
            yield self._chunk([{"index": i, "text": text, "logprobs": block, "finish_reason": finish}])
        if chunk.usage is not None and self.include_usage:
            yield self._chunk([], chunk.usage, last=True)
