"""Speculative decoding in the engine, on the default model: greedy output identical to
decoding without it (and to transformers, fp32) with every proposer, seeded sampling identical
too, and the composition with continuous batching, chunked prefill, preemption, the prefix
cache, max_tokens, stop tokens, aborts, migration and the disaggregated handoff; then one real
1P1D stack speculating in its decode pool (gRPC, stop strings, the OpenAI API, cancellation,
Prometheus).

Drafts: the default model as its own draft (every greedy proposal is kept: the bookkeeping's
test) and a copy of it truncated to its first DRAFT_LAYERS layers (built here; some proposals
are kept, most are not: the rollback's test)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
import torch
from conftest import PROMPTS
from processes import Stack
from safetensors.torch import save_file
from test_engine import LocalHandoff, run
from test_metrics import scrape
from test_stack_e2e import assert_blocks_all_free
from test_stack_e2e import collect as stream

from pdserve.client import build_request
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv_connector import KVReceive, KVSend
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import write_first_layers
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative import SpecStats
from pdserve.engine.speculative import draft as draft_module
from pdserve.engine.speculative.draft import DraftProposer
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e  # loads the default model
MAX_NEW = 20  # as test_engine.py: the transformers references are computed once per session
K = 4
DRAFT_LAYERS = 20  # of 30: fewer layers agree with the model on almost no token
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
# The answer quotes the prompt: n-gram lookup and drafts find much to propose.
EXTRACTIVE = (
    "<|im_start|>user\nRepeat this sentence exactly: The committee met on Tuesday to discuss the harbour, "
    "the schools and the new library.<|im_end|>\n<|im_start|>assistant\n"
)


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="128MiB", num_speculative_tokens=K)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(model_dir))


def collect(engine: LLMEngine) -> dict[str, list[int]]:
    """Steps until nothing is left; the ids each request generated meanwhile."""
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    proposer = engine.speculator.proposer if engine.speculator else None
    if isinstance(proposer, DraftProposer):
        assert not proposer.states and len(proposer.free_blocks) == proposer.cache.num_blocks


@pytest.fixture(scope="module")
def prompt_ids(hf_reference):
    """PROMPTS (the last one has 250+ tokens), then EXTRACTIVE."""
    return [hf_reference.tokenizer(p).input_ids for p in [*PROMPTS, EXTRACTIVE]]


@pytest.fixture(scope="module")
def few(prompt_ids):
    """A short prompt, a chat prompt and the extractive one: enough to exercise each proposer."""
    return [prompt_ids[0], prompt_ids[1], prompt_ids[-1]]


@pytest.fixture(scope="module")
def truncated_draft(model_dir, tmp_path_factory):
    """The default model cut to its first DRAFT_LAYERS layers: a cheap, weaker draft."""
    return write_first_layers(model_dir, DRAFT_LAYERS, tmp_path_factory.mktemp(f"draft-{DRAFT_LAYERS}-layers"))


PROPOSERS = ["ngram", "self-draft", "truncated-draft"]


@pytest.fixture(scope="module")
def engines(model_dir, truncated_draft):
    """An engine per proposer (and 'none'), built when first asked for, shared by the module."""
    built: dict[str, LLMEngine] = {}

    def get(name: str) -> LLMEngine:
        if name not in built:
            if name in ("none", "ngram"):
                built[name] = make_engine(model_dir, speculative=name)
            else:
                draft = model_dir if name == "self-draft" else truncated_draft
                built[name] = make_engine(model_dir, speculative="draft", draft_model=str(draft))
        return built[name]

    return get


@pytest.fixture(params=PROPOSERS)
def spec_engine(request, engines):
    return engines(request.param)


def test_greedy_equals_transformers_in_a_staggered_continuous_batch(spec_engine, few, hf_reference):
    arrivals = [(2 * i, f"r{i}", ids, GREEDY) for i, ids in enumerate(few)]
    arrivals.append((1, "plain", few[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    before = spec_engine.speculator.stats
    got = run(spec_engine, arrivals)
    for i, ids in enumerate(few):
        assert got[f"r{i}"] == hf_reference.greedy(ids, MAX_NEW), f"prompt {i}"
    assert len(got["plain"]) == 8
    after = spec_engine.speculator.stats
    s = SpecStats(*(getattr(after, f) - getattr(before, f) for f in ("drafts", "draft_tokens", "accepted_tokens")))
    assert s.drafts > 0 and s.accepted_tokens > 0
    proposer = spec_engine.speculator.proposer
    if isinstance(proposer, DraftProposer) and proposer.model is spec_engine.model:
        assert s.accepted_tokens == s.draft_tokens  # its own draft: every greedy proposal is kept
    else:
        assert s.accepted_tokens < s.draft_tokens  # some rejected: their slots were rolled back
    assert_all_free(spec_engine)


@pytest.mark.parametrize("proposer", ["ngram", "truncated-draft"])
def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(proposer, engines, few):
    arrivals = [
        (0, "seeded-0", few[2], SamplingParams(max_tokens=16, temperature=0.8, seed=7)),
        (1, "seeded-1", few[1], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=123)),
    ]
    engine = engines(proposer)
    drafts = engine.speculator.stats.drafts
    assert run(engine, arrivals) == run(engines("none"), arrivals)
    assert engine.speculator.stats.drafts > drafts
    assert_all_free(engine)


def test_the_choices_of_a_request_with_n_above_1_carry_no_proposals(engines, few):
    """As documented: every choice of an n > 1 request draws one token per step (choices after
    the first sample with n = 1 settings of their own, and so looked eligible)."""
    engine = engines("ngram")
    drafts = engine.speculator.stats.drafts
    arrivals = [(0, "choices", few[2], SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3))]
    assert run(engine, arrivals) == run(engines("none"), arrivals)
    assert engine.speculator.stats.drafts == drafts
    assert_all_free(engine)


def test_proposals_cut_off_by_a_stop_token_are_not_counted_as_kept(engines, hf_reference):
    """A stop token inside the kept proposals ends the output there: what the draft proposed after
    it never reaches the client, and the counters say what was emitted."""
    engine = engines("self-draft")  # its own draft: every greedy proposal is kept
    comma = hf_reference.tokenizer(",").input_ids[0]
    ids = hf_reference.tokenizer("1, 2, 3, 4, 5,").input_ids
    before = engine.speculator.stats
    sp = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(comma,))
    out = run(engine, [(0, "count", ids, sp)])["count"]
    assert out[-1] == comma and comma not in out[:-1]
    s = engine.speculator.stats
    drafts, kept = s.drafts - before.drafts, s.accepted_tokens - before.accepted_tokens
    # Every proposal is kept: each verification emits them and its own token, but the last, cut
    # at the stop token among its proposals, emits proposals only.
    assert drafts >= 1 and kept == len(out) - drafts
    assert_all_free(engine)


def test_unseeded_sampling_with_a_draft_runs_rejection_sampling(model_dir, truncated_draft, prompt_ids):
    engine = make_engine(model_dir, speculative="draft", draft_model=str(truncated_draft))
    sp = SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)
    got = run(engine, [(i, f"u{i}", prompt_ids[-1], sp) for i in range(4)])
    assert all(len(ids) == 20 for ids in got.values())
    assert engine.speculator.stats.drafts > 0
    assert_all_free(engine)


def test_preemption_under_memory_pressure_keeps_greedy_output(model_dir, prompt_ids, hf_reference):
    requests = [(0, f"{i}-{j}", prompt_ids[i], GREEDY) for i in (0, 4) for j in range(2)]
    admit = sum(-(-len(ids) // 16) for _, _, ids, _ in requests)
    per_block = 16 * 2 * 3 * 64 * 4 * 30  # tokens x (K, V) x kv heads x head dim x fp32 x layers
    tight = make_engine(
        model_dir, speculative="ngram", kv_cache_memory=str((admit + 2) * per_block), enable_prefix_caching=False
    )
    got = run(tight, requests)
    assert tight.scheduler.num_preemptions > 0 and tight.speculator.stats.accepted_tokens > 0
    for _, rid, ids, _ in requests:
        assert got[rid] == hf_reference.greedy(ids, MAX_NEW), rid
    assert_all_free(tight)


def test_small_step_budget_and_chunked_prefill(model_dir, few, hf_reference):
    engine = make_engine(model_dir, speculative="draft", draft_model=str(model_dir), max_num_batched_tokens=24)
    got = run(engine, [(0, str(i), ids, GREEDY) for i, ids in enumerate(few)])
    for i, ids in enumerate(few):
        assert got[str(i)] == hf_reference.greedy(ids, MAX_NEW)
    assert_all_free(engine)


def test_draft_catches_up_on_a_long_prompt_over_several_steps(model_dir, prompt_ids, hf_reference, monkeypatch):
    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 48)
    engine = make_engine(model_dir, speculative="draft", draft_model=str(model_dir))
    long_ids = prompt_ids[3]
    assert len(long_ids) > 4 * 48
    got = run(engine, [(0, "long", long_ids, GREEDY)])["long"]
    assert got == hf_reference.greedy(long_ids, MAX_NEW)
    s = engine.speculator.stats
    assert 0 < s.drafts < MAX_NEW - len(long_ids) // 48 + 1  # no proposal until the draft has seen the prompt
    assert_all_free(engine)


def test_prefix_cache_holds_only_verified_tokens(model_dir, prompt_ids, hf_reference):
    engine = make_engine(model_dir, speculative="ngram", block_size=4)
    ids = prompt_ids[-1]
    out = run(engine, [(0, "a", ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))])["a"]
    assert engine.speculator.stats.draft_tokens > engine.speculator.stats.accepted_tokens  # some were rejected
    tokens = ids + out
    bs = engine.config.block_size
    for block_id in engine.blocks.cached.values():
        block = engine.blocks.blocks[block_id]
        i = next((i for i in range(len(tokens) // bs) if tuple(tokens[i * bs : (i + 1) * bs]) == block.token_ids), None)
        assert i is not None, f"block {block_id} caches tokens that are not in the sequence: {block.token_ids}"
    # The whole verified sequence is reusable: a prompt extending it hits every full block.
    hits = engine.blocks.prefix_hits
    again = run(engine, [(0, "b", tokens[:-1], SamplingParams(max_tokens=4, temperature=0))])["b"]
    assert engine.blocks.prefix_hits - hits == (len(tokens) - 2) // bs
    assert again == hf_reference.greedy(tokens[:-1], 4)
    assert_all_free(engine)


def test_max_tokens_is_never_overshot(engines, prompt_ids):
    engine = engines("self-draft")  # every proposal kept: the most tokens per step
    arrivals = [
        (0, f"m{n}", prompt_ids[-1], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in (1, 2, 3, 6)
    ]
    got = run(engine, arrivals)
    assert {rid: len(ids) for rid, ids in got.items()} == {"m1": 1, "m2": 2, "m3": 3, "m6": 6}
    assert_all_free(engine)


def test_stop_token_inside_kept_proposals_ends_the_output_there(model_dir, prompt_ids, hf_reference):
    engine = make_engine(model_dir, speculative="draft", draft_model=str(model_dir))
    ids = prompt_ids[-1]
    reference = hf_reference.greedy(ids, MAX_NEW)
    stop_at = reference[7]
    got = run(engine, [(0, "s", ids, SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=(stop_at,)))])[
        "s"
    ]
    assert got == reference[: reference.index(stop_at) + 1]
    assert_all_free(engine)


def test_abort_mid_speculation_frees_every_block(model_dir, prompt_ids):
    engine = make_engine(model_dir, speculative="draft", draft_model=str(model_dir))
    engine.add_request("victim", prompt_ids[-1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.add_request("keeper", prompt_ids[0], GREEDY)
    while engine.speculator.stats.drafts < 2:
        engine.step()
    assert engine.abort("victim")
    assert collect(engine).keys() <= {"keeper"}
    assert_all_free(engine)
    # Aborted when nothing else runs: the idle engine's next step lets go of its draft blocks too.
    engine.add_request("alone", prompt_ids[-1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    drafts = engine.speculator.stats.drafts
    while engine.speculator.stats.drafts < drafts + 2:
        engine.step()
    assert engine.abort("alone")
    engine.step()
    assert_all_free(engine)


@pytest.mark.parametrize(
    "proposer, sp",
    [("ngram", GREEDY), ("truncated-draft", SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=42))],
    ids=["ngram-greedy", "draft-seeded"],
)
def test_a_migrated_request_continues_with_the_same_tokens(proposer, sp, engines, prompt_ids):
    """Dynamo-style migration: the request restarts elsewhere with prompt + tokens so far; the
    new worker's proposals start at another place, the tokens are the same."""
    engine = engines(proposer)
    ids = prompt_ids[-1]
    whole = run(engine, [(0, "whole", ids, sp)])["whole"]
    for cut in (1, 5):
        engine.add_request(f"resumed-{cut}", ids + whole[:cut], sp, num_prior_output_tokens=cut)
        assert whole[:cut] + collect(engine)[f"resumed-{cut}"] == whole
    assert_all_free(engine)


def test_disaggregated_handoff_then_draft_decoding(model_dir, truncated_draft, prompt_ids, hf_reference):
    """Prefill in one engine (no speculation), decode with a draft in another: the draft fills
    its own cache from the prompt on the decode side."""
    prefill = make_engine(model_dir)
    decode = make_engine(model_dir, speculative="draft", draft_model=str(truncated_draft), block_size=32)
    ids = prompt_ids[3]
    handoff = LocalHandoff(prefill, decode)
    decode.add_request("r", ids, GREEDY, kv_receive=KVReceive(handoff))
    decode.step()
    prefill.add_request("r", ids, GREEDY, kv_send=KVSend(handoff))
    first = collect(prefill)["r"]
    assert first + collect(decode)["r"] == hf_reference.greedy(ids, MAX_NEW)
    assert decode.speculator.stats.drafts > 0
    assert_all_free(decode)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(speculative="medusa"), "speculative"),
        (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative="draft"), "draft_model"),
        (dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_setting(overrides, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**overrides)


def test_a_draft_model_that_cannot_propose_is_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="draft_model"):
        make_engine(model_dir, speculative="draft", draft_model=str(tmp_path / "missing"))
    folder = tmp_path / "other-vocab"
    folder.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_model: its vocabulary of 32000"):
        make_engine(model_dir, speculative="draft", draft_model=str(folder))


# -- a real stack ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_stack():
    s = Stack.up(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--speculative",
        "ngram",
        "--metrics",
        "--http-port",
        "0",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "128MiB",
    )
    yield s, next(p["http"] for p in s.processes if p["role"] == "router")
    s.down()


async def test_a_1p1d_stack_speculating_in_its_decode_pool(ngram_stack, prompt_ids, hf_reference):
    stack, http = ngram_stack
    metrics = {p["role"]: p["metrics"] for p in stack.processes}
    ids = prompt_ids[-1]
    reference = hf_reference.greedy(ids, MAX_NEW)
    got, text, messages = await stream(
        stack.address, build_request(prompt_token_ids=ids, max_tokens=MAX_NEW, temperature=0)
    )
    assert got == reference
    assert max(len(m.token_ids) for m in messages) > 1  # kept proposals arrive together
    decode = scrape(metrics["decode"])
    assert decode["pdserve_spec_decode_accepted_tokens_total{role=decode}"] > 0
    assert decode["pdserve_spec_decode_mean_accepted_length{role=decode}"] > 1
    assert not any(name.startswith("pdserve_spec_decode") for name in scrape(metrics["prefill"]))

    # A stop string inside a multi-token message ends the text right before it.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    _, stopped, messages = await stream(
        stack.address, build_request(prompt_token_ids=ids, max_tokens=MAX_NEW, temperature=0, stop=[stop])
    )
    assert messages[-1].finish_reason == "stop" and stopped == text[: text.index(stop)]

    # The OpenAI API gives the same text.
    body = json.dumps({"prompt": ids, "max_tokens": MAX_NEW, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{http}/v1/completions", body, {"Content-Type": "application/json"})
    answer = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(request, timeout=120).read()))
    assert answer["choices"][0]["text"] == text

    # Cancelled mid-stream: every block comes back.
    async with grpc.aio.insecure_channel(stack.address) as channel:
        call = pdserve_pb2_grpc.RouterStub(channel).Generate(
            build_request(prompt_token_ids=ids, max_tokens=400, temperature=0, ignore_eos=True), timeout=120
        )
        for _ in range(3):
            await call.read()
        call.cancel()
    await assert_blocks_all_free(stack.address)
