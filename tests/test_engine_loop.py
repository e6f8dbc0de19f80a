"""The engine thread's asyncio bridge, on a scripted engine (no model)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.request_output import KVReservation, KVSent, RequestOutput
from pdserve.engine.sequence import FinishReason


class ScriptedEngine:
    """Emits one token per step for each added request, finishing after ``length`` tokens."""

    def __init__(self, length: int, reservation_first: bool = False) -> None:
        self.length, self.reservation_first = length, reservation_first
        self.requests: dict[str, int] = {}
        self.connector = SimpleNamespace(wake=None)
        self.scheduler = SimpleNamespace(running=[])

    def stats(self, with_digest: bool = False):
        return SimpleNamespace(running=len(self.requests))

    def next_deadline(self):
        return None

    def add(self, rid: str) -> None:
        self.requests[rid] = 0
        self.scheduler.running = list(self.requests)

    def abort(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.scheduler.running = list(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, n in list(self.requests.items()):
            if n == 0 and self.reservation_first:
                outputs.append(RequestOutput(rid, [], None, 3, 0, kv=KVReservation(1, [0], 3, 0)))
            done = n + 1 == self.length
            outputs.append(RequestOutput(rid, [100 + n], FinishReason.LENGTH if done else None, 3, 0, finished=done))
            self.requests[rid] = n + 1
            if done:
                self.abort(rid)
        return outputs


async def _collect(engine: ScriptedEngine, pause_s: float) -> list[RequestOutput]:
    loop = EngineLoop(engine)
    loop.start()
    try:
        got = []
        async for out in loop.generate("r", lambda e: e.add("r")):
            got.append(out)
            await asyncio.sleep(pause_s)  # a slow consumer: the engine runs ahead
        return got
    finally:
        await loop.stop()


async def test_tokens_that_pile_up_go_out_together_in_order():
    outputs = await _collect(ScriptedEngine(length=40), pause_s=0.05)
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert tokens == [100 + i for i in range(40)]  # nothing lost, nothing reordered
    assert len(outputs) < 40  # coalesced
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
    assert not any(out.finished for out in outputs[:-1])


async def test_a_reservation_is_never_merged_with_tokens():
    outputs = await _collect(ScriptedEngine(length=5, reservation_first=True), pause_s=0.05)
    assert isinstance(outputs[0].kv, KVReservation) and outputs[0].new_token_ids == []
    assert [t for out in outputs[1:] for t in out.new_token_ids] == [100, 101, 102, 103, 104]
    assert all(out.kv is None for out in outputs[1:])


class BlockedStepEngine(ScriptedEngine):
    """Its first step blocks until ``release`` is set: commands queue up behind it."""

    def __init__(self) -> None:
        super().__init__(length=3)
        self.in_step, self.release = threading.Event(), threading.Event()
        self.stepped: set[str] = set()

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        self.release.wait(10)
        self.stepped.update(self.requests)
        return super().step()


async def test_a_request_cancelled_while_its_start_is_queued_never_runs():
    engine = BlockedStepEngine()
    loop = EngineLoop(engine)
    loop.start()
    try:
        await asyncio.to_thread(engine.in_step.wait, 10)

        async def consume() -> None:
            async for _ in loop.generate("r", lambda e: e.add("r")):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # ``generate`` has queued its start behind the blocked step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.release.set()
        later = [out async for out in loop.generate("s", lambda e: e.add("s"))]  # queued after r's abort
        assert later[-1].finished and "s" in engine.stepped
        assert "r" not in engine.requests and "r" not in engine.stepped  # added, then aborted at once
    finally:
        engine.release.set()
        await loop.stop()


class TwoChoiceEngine(ScriptedEngine):
    """n = 2 with logprobs: each step one token per choice; choice 0 ends after 6, choice 1 after ``length``."""

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, n in list(self.requests.items()):
            for index, length in ((0, 6), (1, self.length)):
                if n < length:
                    token = 1000 * index + n
                    ends = n + 1 == length
                    outputs.append(
                        RequestOutput(
                            rid,
                            [token],
                            FinishReason.LENGTH if ends else None,
                            3,
                            0,
                            finished=ends and index == 1,
                            index=index,
                            logprobs=[TokenLogprob(-float(token), 1, [], [])],
                        )
                    )
            self.requests[rid] = n + 1
            if n + 1 == self.length:
                self.abort(rid)
        return outputs


async def test_choices_are_merged_each_with_its_own_tokens_logprobs_and_finish():
    outputs = await _collect(TwoChoiceEngine(length=30), pause_s=0.05)
    assert len(outputs) < 36  # coalesced
    for index, length in ((0, 6), (1, 30)):
        mine = [out for out in outputs if out.index == index]
        tokens = [t for out in mine for t in out.new_token_ids]
        assert tokens == [1000 * index + i for i in range(length)]
        assert [lp.logprob for out in mine for lp in out.logprobs] == [-float(t) for t in tokens]
        assert [out.finish_reason for out in mine].count(FinishReason.LENGTH) == 1
        assert mine[-1].finish_reason is FinishReason.LENGTH  # nothing of a choice after its finish
    assert outputs[-1].finished and not any(out.finished for out in outputs[:-1])


class AckedWhileItsFirstTokenIsOnTheWay(ScriptedEngine):
    """A prefill whose handoff is acknowledged (from another thread, at once) while the step
    that sampled its first token has not handed that token over yet; the engine's own copy of
    the acknowledgement comes a step later, as the inbox delivers it."""

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, n in list(self.requests.items()):
            sent = RequestOutput(rid, [], None, 3, 0, finished=True, kv=KVSent("test", 1))
            if n == 0:
                self.connector.deliver_early(sent)
                time.sleep(0.05)  # the acknowledgement reaches the event loop first
                outputs.append(RequestOutput(rid, [100], None, 3, 0))
                self.requests[rid] = 1
            else:
                outputs.append(sent)
                self.abort(rid)
        return outputs


async def test_an_early_acknowledgement_follows_the_first_token_and_its_copy_is_dropped():
    outputs = await _collect(AckedWhileItsFirstTokenIsOnTheWay(length=2), pause_s=0.0)
    assert [out.new_token_ids for out in outputs] == [[100], []]  # the copy never reaches the consumer
    assert outputs[-1].finished and outputs[-1].kv == KVSent("test", 1)


async def test_build_makes_the_engine_on_the_thread_that_steps_it():
    # One thread runs every torch op of the engine: a second OpenMP pool would slow each step.
    threads = {}

    class Recording(ScriptedEngine):
        def __init__(self) -> None:
            super().__init__(length=3)
            threads["built"] = threading.current_thread()

        def step(self) -> list[RequestOutput]:
            threads.setdefault("stepped", threading.current_thread())
            return super().step()

    loop = await EngineLoop.build(Recording)
    try:
        outputs = [out async for out in loop.generate("r", lambda e: e.add("r"))]
    finally:
        await loop.stop()
    assert [t for out in outputs for t in out.new_token_ids] == [100, 101, 102]
    assert threads["built"] is threads["stepped"] is not threading.main_thread()
    assert threads["built"].name == "engine" and not threads["built"].is_alive()


async def test_build_raises_what_building_the_engine_raised():
    def broken() -> ScriptedEngine:
        raise ValueError("model: /nowhere is not a folder")

    with pytest.raises(ValueError, match="/nowhere is not a folder"):
        await EngineLoop.build(broken)
