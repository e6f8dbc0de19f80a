"""The engine on the default model: greedy equality with transformers, continuous batching,
the disaggregation seam, preemption, aborts, block accounting. (Sampling settings' own
checks: test_request_rules.py.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import PROMPTS

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_connector import KVReceive, KVSend, TransferOutcome
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import KVSent, RequestRejected
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.kvtransfer.layout import KVCacheView

pytestmark = pytest.mark.e2e  # loads the default model
MAX_NEW = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="256MiB")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(model_dir))


def run(engine: LLMEngine, arrivals: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Steps the engine, adding each request at its step; returns the generated ids."""
    outputs: dict[str, list[int]] = {rid: [] for _, rid, _, _ in arrivals}
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids, sp = pending.pop(0)
            engine.add_request(rid, ids, sp)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        step += 1
        assert step < 10_000
    return outputs


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert not engine.connector.sending
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(hf_reference):
    ids = [hf_reference.tokenizer(p).input_ids for p in PROMPTS]
    assert max(len(i) for i in ids) >= 250
    return ids


def test_conversion_keeps_gguf_weights_exactly(model_dir, hf_reference):
    from pdserve.engine.loader import load_state_dict

    ours = load_state_dict(model_dir, torch.float32)
    theirs = hf_reference.model.state_dict()
    assert ours.keys() <= theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_one_at_a_time_matches_transformers(engine, prompt_ids, hf_reference):
    for i, ids in enumerate(prompt_ids):
        got = run(engine, [(0, f"solo-{i}", ids, GREEDY)])[f"solo-{i}"]
        assert got == hf_reference.greedy(ids, MAX_NEW), f"prompt {i} ({len(ids)} tokens)"
    assert_all_free(engine)


def test_greedy_continuous_batch_with_staggered_arrivals(engine, prompt_ids, hf_reference):
    # Requests join while others are mid-decode; the long prompt arrives last.
    arrivals = [(3 * i, f"batch-{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids)]
    arrivals += [(1, "batch-dup", prompt_ids[0], GREEDY)]
    got = run(engine, arrivals)
    for i, ids in enumerate(prompt_ids):
        assert got[f"batch-{i}"] == hf_reference.greedy(ids, MAX_NEW), f"prompt {i}"
    assert got["batch-dup"] == got["batch-0"]
    assert_all_free(engine)


def test_chunked_prefill_matches_unchunked(model_dir, prompt_ids, hf_reference):
    small_budget = make_engine(model_dir, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    got = run(small_budget, [(0, str(i), ids, GREEDY) for i, ids in enumerate(prompt_ids)])
    for i, ids in enumerate(prompt_ids):
        assert got[str(i)] == hf_reference.greedy(ids, MAX_NEW)
    assert_all_free(small_budget)


def test_unchunked_prompt_waiting_for_an_empty_step_is_looked_up_once(model_dir):
    """Without chunking, a prompt over the step's leftover budget waits for a later step; the
    prefix cache must count its lookup once, when it is admitted, not on every step it waits."""
    engine = make_engine(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=256, kv_cache_memory="64MiB")
    prompts = [list(range(1000, 1200)), list(range(2000, 2200))]  # each fits a step alone, not both together
    run(engine, [(0, str(i), ids, SamplingParams(max_tokens=2, temperature=0)) for i, ids in enumerate(prompts)])
    assert engine.blocks.prefix_queries == sum(len(ids) // engine.config.block_size for ids in prompts)
    assert_all_free(engine)


def test_prefix_cache_hit_gives_identical_tokens(engine, prompt_ids, hf_reference):
    long_ids = prompt_ids[-1]
    hits_before = engine.blocks.prefix_hits
    first = run(engine, [(0, "pc-1", long_ids, GREEDY)])["pc-1"]
    second = run(engine, [(0, "pc-2", long_ids, GREEDY)])["pc-2"]
    assert engine.blocks.prefix_hits - hits_before >= len(long_ids) // engine.config.block_size - 1
    assert first == second == hf_reference.greedy(long_ids, MAX_NEW)
    assert_all_free(engine)


def test_preemption_under_memory_pressure_keeps_greedy_output(model_dir, prompt_ids, hf_reference):
    # Six requests fit when admitted but not once their outputs grow: decodes must preempt.
    requests = [(0, f"{i}-{j}", prompt_ids[i], GREEDY) for i in (0, 2) for j in range(3)]
    admit = sum(-(-len(ids) // 16) for _, _, ids, _ in requests)
    grown = sum(-(-(len(ids) + MAX_NEW) // 16) for _, _, ids, _ in requests)
    assert grown > admit + 2
    per_block = 16 * 2 * 3 * 64 * 4 * 30  # tokens x (K, V) x kv heads x head dim x fp32 x layers
    tight = make_engine(model_dir, kv_cache_memory=str((admit + 2) * per_block), enable_prefix_caching=False)
    assert tight.blocks.num_blocks == admit + 2
    got = run(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    for _, rid, ids, _ in requests:
        assert got[rid] == hf_reference.greedy(ids, MAX_NEW), rid
    assert_all_free(tight)


def test_a_request_that_could_outgrow_the_whole_cache_is_refused(model_dir, prompt_ids):
    """It would preempt itself once it filled the cache and then wait forever at the head of
    the queue, with every later request behind it."""
    per_block = 16 * 2 * 3 * 64 * 4 * 30
    small = make_engine(model_dir, kv_cache_memory=str(4 * per_block))
    prompt = prompt_ids[0]
    fits = 4 * 16 - len(prompt)
    small.validate(prompt, SamplingParams(max_tokens=fits))
    with pytest.raises(ValueError, match="sampling.max_tokens: .* need 5 KV blocks; .* has 4"):
        small.add_request("too-long", prompt, SamplingParams(max_tokens=fits + 1))
    with pytest.raises(ValueError, match="for 2 choices"):
        small.validate(prompt, SamplingParams(max_tokens=fits, n=2, temperature=1.0))
    small.validate(prompt, SamplingParams(max_tokens=fits + 100), generates=False)  # a prefill worker's part fits
    assert not small.has_unfinished()


def test_abort_frees_blocks_and_others_continue(engine, prompt_ids, hf_reference):
    engine.add_request("victim", prompt_ids[-1], GREEDY)
    engine.add_request("keeper", prompt_ids[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("victim")
    assert not engine.abort("victim")
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "keeper"
            got += out.new_token_ids
    # The keeper's first token came from the first step: compare the tail.
    assert got == hf_reference.greedy(prompt_ids[0], MAX_NEW)[-len(got) :]
    assert_all_free(engine)


class LocalHandoff:
    """Both worker halves of one transfer, in-process: each layer is copied between the two
    engines' caches as the prefill forward computes it (what kvtransfer does over a wire)."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        self.src = KVCacheView(prefill.kv_cache.layers, prefill.config.block_size, prefill.kv_layout.token_bytes)
        self.dst = KVCacheView(decode.kv_cache.layers, decode.config.block_size, decode.kv_layout.token_bytes)
        self.layers_sent = 0

    # the decode side's IncomingKV
    def grant(self, block_ids, num_tokens, skip_tokens, report) -> int:
        self.dst_blocks, self.num_tokens, self.decode_report = block_ids, num_tokens, report
        return 1

    # the prefill side's OutgoingKV
    def send_layer(self, layer, block_ids, start, end) -> None:
        data = self.src.read(layer, self.src.slots(block_ids, start, end))
        self.dst.scatter(layer, self.dst.slots(self.dst_blocks, start, end), data.data)
        data.release()
        self.layers_sent += 1

    def finish(self, first_token_id, report) -> None:
        self.decode_report(TransferOutcome(True, first_token_id=first_token_id, transport="local"))
        report(TransferOutcome(True, transport="local", nbytes=123))

    def cancel(self, *transfer_id_and_reason) -> None:  # both halves' cancel
        raise AssertionError("nothing cancels this transfer")


@pytest.mark.parametrize("one_token_left", [False, True])
def test_seam_prefill_here_decode_there(model_dir, prompt_ids, hf_reference, one_token_left):
    """Prefill in one engine, decode in another (another block size): the KV connector on both
    sides, with the bytes copied layer by layer during the prefill's forward pass. With
    ``one_token_left`` the chunks leave the last prompt token to a decode chunk of its own."""
    ids = prompt_ids[-1]
    budget = len(ids) - 1 if one_token_left else 128
    prefill = make_engine(model_dir, block_size=16, max_num_batched_tokens=budget)  # chunked: several steps
    prefill.connector.pipelined = True  # as with a core to spare, whatever this machine has (thread_budget)
    decode = make_engine(model_dir, block_size=32)
    handoff = LocalHandoff(prefill, decode)
    decode.add_request("r", ids, GREEDY, kv_receive=KVReceive(handoff))
    [reserved] = decode.step()
    assert reserved.kv.num_tokens == len(ids) and reserved.kv.num_cached_tokens == 0 and not reserved.finished

    prefill.add_request("r", ids, GREEDY, kv_send=KVSend(handoff))
    outputs = []
    while prefill.has_unfinished():
        outputs += prefill.step()
    first, acked = outputs
    assert first.new_token_ids and not first.finished and first.finish_reason is None
    assert acked.finished and acked.kv == KVSent("local", 123) and acked.new_token_ids == []
    assert handoff.layers_sent == prefill.model_config.num_layers * -(-len(ids) // budget)
    assert_all_free(prefill)

    rest = []
    while decode.has_unfinished():
        for out in decode.step():
            rest += out.new_token_ids
    assert first.new_token_ids + rest == hf_reference.greedy(ids, MAX_NEW)
    assert_all_free(decode)


class AckedDuringNextStep:
    """An OutgoingKV whose decode side acknowledges, from its own thread, once the prefill
    engine's next step is under way."""

    def __init__(self, step_running: threading.Event) -> None:
        self.step_running = step_running

    def send_layer(self, layer, block_ids, start, end) -> None:
        pass

    def finish(self, first_token_id, report) -> None:
        def ack() -> None:
            self.step_running.wait(5)
            report(TransferOutcome(True, transport="test", nbytes=7))

        threading.Thread(target=ack).start()

    def cancel(self) -> None:
        pass

    close = cancel


async def test_an_acknowledged_handoff_does_not_wait_for_the_step_in_progress(model_dir, prompt_ids):
    """A short prompt finishes its prefill while a long one goes on in chunks; its handoff is
    acknowledged during the next step, and the prefill's answer (which carries the first token
    to the client) must not wait for that step to end: the step waits for it instead."""
    engine = make_engine(model_dir, max_num_batched_tokens=64)
    step_running, answered, waits = threading.Event(), threading.Event(), []
    run = engine.runner.run

    def run_held_while_the_short_prompt_waits_for_its_ack(schedule, hook):
        if engine.connector.sending:
            step_running.set()
            waits.append(answered.wait(5))  # False: the answer waited for this step to end
        return run(schedule, hook)

    engine.runner.run = run_held_while_the_short_prompt_waits_for_its_ack
    loop = EngineLoop(engine)
    loop.start()
    try:
        long_prompt = asyncio.ensure_future(
            _drain(loop.generate("long", lambda e: e.add_request("long", prompt_ids[-1], GREEDY)))
        )
        send = KVSend(AckedDuringNextStep(step_running))
        outputs = []
        async for out in loop.generate("short", lambda e: e.add_request("short", prompt_ids[0], GREEDY, kv_send=send)):
            outputs.append(out)
            if out.finished:
                answered.set()
        assert outputs[0].new_token_ids and outputs[-1].finished and outputs[-1].kv == KVSent("test", 7)
        assert len(await asyncio.wait_for(long_prompt, 60)) == MAX_NEW
        assert waits == [True]  # answered while the next step was held
    finally:
        await loop.stop()
    assert_all_free(engine)


async def _drain(outputs) -> list[int]:
    return [t async for out in outputs for t in out.new_token_ids]


def test_seeded_sampling_is_reproducible(engine, prompt_ids):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = run(engine, [(0, "s1", prompt_ids[2], sp)])["s1"]
    # Same seed inside a batch with other traffic, arriving later: same tokens.
    b = run(
        engine,
        [(0, "noise", prompt_ids[1], SamplingParams(max_tokens=8, temperature=1.0)), (2, "s2", prompt_ids[2], sp)],
    )["s2"]
    c = run(
        engine,
        [(0, "s3", prompt_ids[2], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=99))],
    )["s3"]
    assert a == b
    assert a != c  # different seeds diverge (12 tokens at temperature 0.9)
    assert_all_free(engine)


def test_stop_token_ids_and_ignore_eos(engine, prompt_ids, hf_reference):
    ids = prompt_ids[0]
    reference = hf_reference.greedy(ids, MAX_NEW)
    stop_at = reference[4]
    out = run(engine, [(0, "stop", ids, SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=(stop_at,)))])
    assert out["stop"] == reference[: reference.index(stop_at) + 1]
    eos = engine.model_config.eos_token_ids[0]
    sp = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(), ignore_eos=True)
    # The chat prompt ends its answer with EOS; ignore_eos runs past it to max_tokens.
    chat = prompt_ids[1]
    normal = run(engine, [(0, "n", chat, SamplingParams(max_tokens=64, temperature=0))])["n"]
    assert normal[-1] == eos
    assert (
        len(
            run(engine, [(0, "i", chat, SamplingParams(max_tokens=len(normal) + 3, temperature=0, ignore_eos=True))])[
                "i"
            ]
        )
        == len(normal) + 3
    )
    assert len(run(engine, [(0, "m", ids, sp)])["m"]) == 6
    assert_all_free(engine)


@pytest.mark.parametrize(
    "ids, sampling, field",
    [
        ([], GREEDY, "prompt_token_ids"),
        ([1, 2, 49152], GREEDY, "prompt_token_ids"),
        ([1, -3], GREEDY, "prompt_token_ids"),
        (list(range(8192)), GREEDY, "prompt_token_ids"),
        ([1] * 8000, SamplingParams(max_tokens=500), "max_tokens"),
        ([1, 2], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_bad_requests_raise_value_error_naming_the_field(engine, ids, sampling, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", ids, sampling)
    assert not engine.has_unfinished()


def test_engine_keeps_serving_after_bad_request(engine, prompt_ids, hf_reference):
    with pytest.raises(ValueError):
        engine.add_request("bad", [10**9], GREEDY)
    assert run(engine, [(0, "good", prompt_ids[0], GREEDY)])["good"] == hf_reference.greedy(prompt_ids[0], MAX_NEW)
    assert_all_free(engine)


def test_swap_preemption_keeps_greedy_output(model_dir, prompt_ids, hf_reference):
    """Preempted sequences go to host memory and come back (the GPU path, forced here on CPU)."""
    requests = [(0, f"{i}-{j}", prompt_ids[i], GREEDY) for i in (0, 2) for j in range(3)]
    admit = sum(-(-len(ids) // 16) for _, _, ids, _ in requests)
    per_block = 16 * 2 * 3 * 64 * 4 * 30
    engine = make_engine(
        model_dir,
        kv_cache_memory=str((admit + 2) * per_block),
        enable_prefix_caching=False,
        preemption_mode="swap",
        swap_space="64MiB",
    )
    got = run(engine, requests)
    assert engine.swap.swapped_out > 0 and engine.swap.swapped_in == engine.swap.swapped_out
    for _, rid, ids, _ in requests:
        assert got[rid] == hf_reference.greedy(ids, MAX_NEW), rid
    assert_all_free(engine)
    assert engine.swap.num_free == engine.swap.host.shape[1]


def test_priority_decides_admission_and_preemption(model_dir, prompt_ids):
    per_block = 16 * 2 * 3 * 64 * 4 * 30
    engine = make_engine(model_dir, kv_cache_memory=str(6 * per_block), enable_prefix_caching=False, max_num_seqs=2)
    long_out = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("low-1", prompt_ids[2], long_out, priority=5)
    engine.add_request("low-2", prompt_ids[2], long_out, priority=5)
    engine.add_request("high", prompt_ids[2], long_out, priority=-5)  # arrives last, admitted first
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert "high" in running and len(running) == 2
    finished_order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason is not None:
                finished_order.append(out.request_id)
    assert finished_order[0] == "high"
    # Blocks ran out while two requests decoded: the low-priority one was the victim.
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_ttft_budget_rejects_requests_that_cannot_start_in_time(model_dir, prompt_ids):
    engine = make_engine(model_dir, max_num_seqs=1)
    engine.add_request("busy", prompt_ids[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("impatient", prompt_ids[1], GREEDY, ttft_budget_s=0.001)
    engine.add_request("patient", prompt_ids[1], SamplingParams(max_tokens=2, temperature=0), ttft_budget_s=600)
    outcomes = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outcomes[out.request_id] = out.error or out.finish_reason
    assert isinstance(outcomes["impatient"], RequestRejected)
    assert outcomes["patient"] in (FinishReason.STOP, FinishReason.LENGTH)
    with pytest.raises(ValueError, match="ttft_budget_ms"):
        engine.add_request("zero", prompt_ids[1], GREEDY, ttft_budget_s=0)
    assert_all_free(engine)


def test_a_kv_cache_the_machine_cannot_hold_is_refused_by_its_setting(model_dir):
    """Past any address space: the setting and the size, not a bare ENOMEM."""
    with pytest.raises(ValueError, match=r"^kv_cache_memory 200000GiB: cannot allocate \d+\.\d GiB \("):
        make_engine(model_dir, kv_cache_memory="200000GiB")


def test_max_model_len_caps_the_context_below_the_models(model_dir):
    engine = make_engine(model_dir, max_model_len=40)
    assert engine.max_model_len == 40
    with pytest.raises(ValueError, match="leave no room in the model's context of 40"):
        engine.validate(list(range(100, 140)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceed the context of 40"):
        engine.validate(list(range(100, 130)), SamplingParams(max_tokens=11))
    engine.add_request("r", list(range(100, 130)), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason.value == "length" and sum(len(o.new_token_ids) for o in outputs) == 10
    with pytest.raises(ValueError, match=r"max_model_len: 9000 must be in \[2, 8192\]"):
        make_engine(model_dir, max_model_len=9000)
