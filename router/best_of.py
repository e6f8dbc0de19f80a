"""``best_of``: the workers generate that many choices of one prompt (prefilled once); the
client gets the ``n`` whose tokens are most likely together (highest cumulative logprob, as
OpenAI and vLLM rank them), once every choice is done. Nothing can stream before then."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from pdserve.router.completions import Chunk
from pdserve.v1 import pdserve_pb2 as pb


@dataclass(slots=True)
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[pb.TokenLogprob] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


async def best_of(chunks: AsyncIterator[Chunk], n: int, keep_logprobs: bool) -> AsyncIterator[Chunk]:
    """Collects every choice of ``chunks`` (which carry logprobs) and yields the ``n`` best,
    one chunk each, re-indexed 0..n-1 in rank order; the last carries the usage.
    ``keep_logprobs``: whether the client asked for logprobs (else they are dropped)."""
    choices: dict[int, _Choice] = {}
    prompt_logprobs, last = None, None
    async for chunk in chunks:
        choice = choices.setdefault(chunk.index, _Choice())
        choice.token_ids += chunk.token_ids
        choice.text.append(chunk.text)
        choice.logprobs += chunk.logprobs
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
        if chunk.prompt_logprobs is not None:
            prompt_logprobs = chunk.prompt_logprobs
        last = chunk
    ranked = sorted(choices.values(), key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    # As vLLM: the usage counts the tokens of the choices returned, not of the candidates dropped.
    usage = last.usage if last is not None else None
    if usage is not None:
        usage = replace(usage, completion_tokens=sum(len(c.token_ids) for c in ranked))
    for index, choice in enumerate(ranked):
        yield Chunk(
            choice.token_ids,
            "".join(choice.text),
            choice.finish_reason,
            usage=usage if index == len(ranked) - 1 else None,
            index=index,
            logprobs=choice.logprobs if keep_logprobs else [],
            prompt_logprobs=prompt_logprobs if index == 0 else None,
        )
