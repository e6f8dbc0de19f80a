"""Migrating n > 1 choices: when the worker serving several choices fails after tokens went
out, each unfinished choice continues as a request of its own (the prompt plus that choice's
tokens, its own seed, one choice), on whatever workers the dispatcher picks, all at once. The
continuation draws exactly the tokens the choice would have drawn (the sampler's noise depends
on the seed and the token's index only), and its structured-output state is rebuilt from its
tokens; its events are re-numbered with the choice's index and merged into one stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator

from pdserve.request_rules import choice_seed
from pdserve.router.validation import ValidatedRequest

if TYPE_CHECKING:
    from pdserve.router.choice_ends import ChoiceEnds
    from pdserve.router.dispatch import Dispatcher, TokenEvent


def one_choice(req: ValidatedRequest, index: int) -> ValidatedRequest:
    sampling = req.engine_sampling
    return replace(
        req, best_of=None, sampling=replace(sampling, n=1, seed=choice_seed(sampling.seed, index), prompt_logprobs=None)
    )


async def continue_choices(
    dispatcher: Dispatcher,
    req: ValidatedRequest,
    priors: dict[int, list[int]],
    ended: set[int],
    deadline: float,
    ends: ChoiceEnds | None = None,
) -> AsyncIterator[TokenEvent]:
    """``ended``: choices that finished; ``ends``: those the caller ends (a stop string), now or later."""
    queue: asyncio.Queue = asyncio.Queue()
    timeout_s = max(0.001, deadline - time.monotonic())

    async def run(index: int) -> None:
        try:
            stream = dispatcher.generate(one_choice(req, index), timeout_s, prior=priors.get(index, []))
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    await queue.put(replace(event, index=index, prompt_logprobs=None))
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)

    skip = ended | (ends.ended if ends is not None else set())
    tasks = {i: asyncio.create_task(run(i)) for i in range(req.engine_sampling.n) if i not in skip}

    def end(indices: set[int]) -> None:  # closing a one-choice call aborts it on its worker
        for i in indices & tasks.keys():
            if not tasks[i].done():  # else it has said its last (its None, or its error)
                tasks[i].cancel()
                queue.put_nowait(None)  # it says nothing more

    try:
        with ends.listening(end) if ends is not None else contextlib.nullcontext():
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
