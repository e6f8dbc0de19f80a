"""API parity inside the engine, on the default model in fp32: logprobs and prompt logprobs
equal transformers' log_softmax (chunked prefill and prefix-cached prompts included); n > 1
forks share the prompt's blocks (copy-on-write of the last partial one), give distinct and
reproducible choices and free every block; structured output holds for 20+ JSON schemas,
regexes and choices, and greedy + schema is deterministic."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import PROMPTS
from schemas import SCHEMAS

from pdserve.engine.choices import choice_seed
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.request_rules import Constraint, InvalidRequest

pytestmark = pytest.mark.e2e  # loads the default model
TOLERANCE = 1e-4


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="128MiB")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model_dir=str(model_dir))


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[tuple[str, int], dict]:
    """Adds the requests, steps until done; per (request, choice): ids, logprobs, prompt logprobs, finish."""
    for rid, ids, sp in requests:
        engine.add_request(rid, ids, sp)
    got: dict[tuple[str, int], dict] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            r = got.setdefault((out.request_id, out.index), {"ids": [], "logprobs": [], "prompt": None, "finish": None})
            r["ids"] += out.new_token_ids
            r["logprobs"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                r["prompt"] = out.prompt_logprobs
            r["finish"] = out.finish_reason or r["finish"]
        steps += 1
        assert steps < 5_000
    assert engine.blocks.num_free == engine.blocks.num_blocks, "blocks leaked"
    return got


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def tokenizer(hf_reference):
    return hf_reference.tokenizer


def reference_logprobs(hf_reference, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 log_softmax at every position of ``ids`` ([T, V]; row i predicts ids[i + 1])."""
    with torch.inference_mode():
        logits = hf_reference.model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def assert_matches(lp, reference_row: torch.Tensor, token_id: int, num_top: int) -> None:
    assert abs(lp.logprob - reference_row[token_id].item()) < TOLERANCE
    assert (
        lp.rank == int((reference_row > reference_row[token_id]).sum()) + 1
        or abs(lp.logprob - reference_row.max().item()) < TOLERANCE
    )  # ties within the tolerance may rank either way
    assert len(lp.top_token_ids) == num_top
    want = reference_row.topk(num_top).values.tolist()
    assert lp.top_logprobs == pytest.approx(want, abs=TOLERANCE)
    for t, v in zip(lp.top_token_ids, lp.top_logprobs):
        assert abs(reference_row[t].item() - v) < TOLERANCE


@pytest.mark.parametrize("budget", [1024, 48], ids=["whole-prompt", "chunked-prefill"])
def test_logprobs_and_prompt_logprobs_equal_transformers(model_dir, hf_reference, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    ids = hf_reference.tokenizer(PROMPTS[3]).input_ids  # 250+ tokens: several chunks at budget 48
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    got = run(engine, [("lp", ids, sp)])[("lp", 0)]
    reference = reference_logprobs(hf_reference, ids + got["ids"])
    assert len(got["prompt"]) == len(ids) - 1 and len(got["logprobs"]) == len(got["ids"]) == 6
    for p, lp in enumerate(got["prompt"]):  # position p predicts prompt token p + 1
        assert_matches(lp, reference[p], ids[p + 1], 3)
    for k, (token_id, lp) in enumerate(zip(got["ids"], got["logprobs"])):
        assert_matches(lp, reference[len(ids) - 1 + k], token_id, 5)
        assert lp.rank == 1  # greedy


def test_a_cached_prompt_still_gets_its_logprobs(engine, hf_reference):
    ids = hf_reference.tokenizer(PROMPTS[2] * 3).input_ids
    run(engine, [("warm", ids, SamplingParams(max_tokens=1, temperature=0))])  # the prompt's blocks are cached now
    hits = engine.blocks.prefix_hits
    got = run(engine, [("again", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))])[("again", 0)]
    assert engine.blocks.prefix_hits == hits, (
        "a prompt whose logprobs are wanted is recomputed, not read from the cache"
    )
    reference = reference_logprobs(hf_reference, ids)
    assert len(got["prompt"]) == len(ids) - 1
    for p, lp in enumerate(got["prompt"]):
        assert abs(lp.logprob - reference[p, ids[p + 1]].item()) < TOLERANCE and lp.top_token_ids == []
    hits = engine.blocks.prefix_hits
    run(engine, [("plain", ids, SamplingParams(max_tokens=1, temperature=0))])
    assert engine.blocks.prefix_hits > hits, "other requests still hit the cache"


def test_logprobs_come_from_the_raw_distribution(engine, hf_reference):
    """Before temperature and top-p (as OpenAI and vLLM report them): the same numbers at any temperature."""
    ids = hf_reference.tokenizer(PROMPTS[0]).input_ids
    cold = run(engine, [("cold", ids, SamplingParams(max_tokens=1, temperature=0, logprobs=4))])[("cold", 0)]
    hot = run(engine, [("hot", ids, SamplingParams(max_tokens=1, temperature=5.0, top_p=0.5, seed=1, logprobs=4))])[
        ("hot", 0)
    ]
    assert hot["logprobs"][0].top_logprobs == pytest.approx(cold["logprobs"][0].top_logprobs, abs=1e-6)


# -- n > 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_tokens", [37, 48], ids=["partial-last-block", "block-boundary"])
def test_n_choices_are_distinct_reproducible_and_share_the_prompt(engine, prompt_tokens):
    ids = list(range(1000, 1000 + prompt_tokens))
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    first = run(engine, [("n4", ids, sp)])
    forks = engine.choices.num_forks
    again = run(engine, [("n4", ids, sp)])
    assert engine.choices.num_forks - forks == 3 and engine.choices.num_recomputed == 0
    texts = [tuple(first[("n4", i)]["ids"]) for i in range(4)]
    assert len(set(texts)) == 4, "four distinct completions"
    assert texts == [tuple(again[("n4", i)]["ids"]) for i in range(4)], "reproducible with the seed"
    assert all(first[("n4", i)]["finish"].value == "length" for i in range(4))
    # Choice i samples exactly as a one-choice request with its own seed (choice 0: the request's).
    for i in (0, 2):
        solo = run(
            engine,
            [("solo", ids, SamplingParams(max_tokens=12, temperature=1.0, seed=choice_seed(1234, i), ignore_eos=True))],
        )
        assert tuple(solo[("solo", 0)]["ids"]) == texts[i]


def test_forks_share_blocks_and_copy_only_the_partial_one(engine):
    ids = list(range(2000, 2037))  # 37 tokens: two full blocks and a partial one
    engine.add_request("share", ids, SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True))
    free = engine.blocks.num_free
    while not engine.requests["share"].group:
        engine.step()
    seqs = engine.requests["share"].group.seqs
    tables = [s.block_table for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables), "the full prompt blocks are shared"
    assert len({t[2] for t in tables}) == 3, "each choice writes its own copy of the partial block"
    assert free - engine.blocks.num_free <= 3 + 2, "three prompt blocks plus one copy per fork"
    engine.abort("share")
    assert engine.blocks.num_free == engine.blocks.num_blocks


def steps_until(engine: LLMEngine, done, got: dict[int, list[int]]) -> None:
    """Steps until ``done()``, collecting each choice's tokens into ``got``."""
    while not done():
        for out in engine.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)


def test_a_choice_the_router_ends_stops_at_once_and_the_others_go_on_unchanged(engine):
    """Stop strings are the router's: it ends a choice that met one (``end_choices``), which then
    gives back its batch slot and blocks while the others draw the tokens they would have."""
    ids = list(range(5000, 5037))
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=21, n=3, ignore_eos=True)
    want = run(engine, [("all", ids, sp)])
    engine.add_request("some", ids, sp)
    got: dict[int, list[int]] = {}
    steps_until(engine, lambda: len(got.get(1, [])) >= 3, got)
    ended_before, free = engine.choices.num_ended, engine.blocks.num_free
    outs = engine.end_choices("some", [1])
    assert [(o.index, o.new_token_ids, o.finish_reason, o.finished) for o in outs] == [
        (1, [], FinishReason.STOP, False)
    ]
    assert engine.choices.num_ended == ended_before + 1 and engine.blocks.num_free > free
    assert sorted(s.choice for s in engine.scheduler.running) == [0, 2]
    steps_until(engine, lambda: not engine.has_unfinished(), got)
    assert got[1] == want[("all", 1)]["ids"][: len(got[1])] and len(got[1]) == 3
    assert got[0] == want[("all", 0)]["ids"] and got[2] == want[("all", 2)]["ids"]
    assert engine.end_choices("some", [0]) == [] and engine.blocks.num_free == engine.blocks.num_blocks


def test_choices_ended_before_they_fork_end_as_they_fork(engine):
    ids = list(range(6000, 6021))
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=8, n=3, ignore_eos=True)
    want = run(engine, [("all", ids, sp)])
    engine.add_request("early", ids, sp)
    assert engine.end_choices("early", [0, 2]) == []  # not forked yet: remembered
    got: dict[int, list[int]] = {}
    steps_until(engine, lambda: not engine.has_unfinished(), got)
    assert got == {0: want[("all", 0)]["ids"][:1], 1: want[("all", 1)]["ids"], 2: want[("all", 2)]["ids"][:1]}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_forks_keep_to_max_num_seqs_and_give_the_same_tokens(model_dir):
    """n = 4 with room for one sequence: the choices run one after another (each recomputes its
    prompt from the prefix cache), never more at once than max_num_seqs, with the same tokens."""
    ids = list(range(4000, 4037))
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True)
    want = run(make_engine(model_dir), [("r", ids, sp)])
    narrow = make_engine(model_dir, max_num_seqs=1)
    narrow.add_request("r", ids, sp)
    most, got = 0, {}
    while narrow.has_unfinished():
        for out in narrow.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
        most = max(most, len(narrow.scheduler.running))
    assert most == 1 and narrow.choices.num_recomputed == 3
    assert got == {i: want[("r", i)]["ids"] for i in range(4)}
    assert narrow.blocks.num_free == narrow.blocks.num_blocks


def test_a_fork_without_free_blocks_recomputes_and_gives_the_same_tokens(model_dir):
    ids = list(range(3000, 3037))
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=3, ignore_eos=True)
    roomy = make_engine(model_dir, kv_cache_memory="32MiB")
    want = run(roomy, [("r", ids, sp)])
    tight = make_engine(model_dir, kv_cache_memory="32MiB")
    hog = tight.blocks.allocate_blocks_raw(tight.blocks.num_free - 3)  # room for the prompt only
    tight.add_request("r", ids, sp)
    while not tight.requests["r"].group:
        tight.step()
    tight.blocks.free_blocks(hog)
    assert tight.choices.num_recomputed == 2
    got = {}
    while tight.has_unfinished():
        for out in tight.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
    assert all(want[("r", i)]["ids"][1:] == got[i] for i in range(3))
    assert tight.blocks.num_free == tight.blocks.num_blocks


# -- structured output ----------------------------------------------------------------------------
def test_twenty_json_schemas_all_parse_and_validate(engine, tokenizer):
    assert len(SCHEMAS) >= 20
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with a JSON object."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    requests = [
        (
            f"s{i}",
            prompt,
            SamplingParams(
                max_tokens=200,
                temperature=0.7,
                seed=i,
                n=2 if i % 5 == 0 else 1,
                constraint=Constraint("json_schema", json.dumps(schema)),
            ),
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    got = run(engine, requests)  # one batch: every row with its own mask
    for (rid, _choice), r in got.items():
        schema = SCHEMAS[int(rid[1:])]
        assert r["finish"].value == "stop", f"{rid}: hit max_tokens: {tokenizer.decode(r['ids'])!r}"
        jsonschema.validate(json.loads(tokenizer.decode(r["ids"], skip_special_tokens=True)), schema)


def test_regex_and_choice_constraints_hold(engine, tokenizer):
    prompt = tokenizer("My phone number and favourite colour:").input_ids
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    colours = ("crimson", "teal", "golden yellow")
    got = run(
        engine,
        [
            (
                "re",
                prompt,
                SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=3, constraint=Constraint("regex", regex)),
            ),
            (
                "ch",
                prompt,
                SamplingParams(
                    max_tokens=30, temperature=1.0, seed=4, n=3, constraint=Constraint("choice", choices=colours)
                ),
            ),
        ],
    )
    for i in range(3):
        assert re.fullmatch(regex, tokenizer.decode(got[("re", i)]["ids"], skip_special_tokens=True))
        assert tokenizer.decode(got[("ch", i)]["ids"], skip_special_tokens=True) in colours


def test_greedy_with_a_schema_is_deterministic(engine, tokenizer):
    prompt = tokenizer("A user record:").input_ids
    sp = SamplingParams(max_tokens=120, temperature=0, constraint=Constraint("json_schema", json.dumps(SCHEMAS[1])))
    outputs = [run(engine, [("g", prompt, sp)])[("g", 0)]["ids"] for _ in range(2)]
    batched = run(
        engine, [("g1", prompt, sp), ("other", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=1))]
    )
    assert outputs[0] == outputs[1] == batched[("g1", 0)]["ids"]


def test_json_mode_takes_an_object_and_nothing_else(engine, tokenizer):
    """``json_object`` is OpenAI's JSON mode: an object (any keys and values, any whitespace), not
    any JSON value."""
    cases = [('{"a": [1, {"b": null}]}', True), ('{\n  "k": "v"\n}', True), ("[1, 2]", False), ('"s"', False)]
    for text, accepted in cases:
        matcher = engine.grammars.state(Constraint("json_object")).matcher  # a fresh matcher each time
        assert matcher.accept_string(text) is accepted, text


def test_a_grammar_that_accepts_no_string_is_refused_naming_the_field(engine):
    for text in ("root ::= root", "root ::= a\na ::= b\nb ::= a"):
        with pytest.raises(
            InvalidRequest, match=r"^sampling\.structured_output\.grammar: the grammar accepts no string"
        ):
            engine.compile_constraint(SamplingParams(constraint=Constraint("grammar", text)))
    engine.compile_constraint(SamplingParams(constraint=Constraint("regex", " ")))  # blanks: a fine regex


def test_a_grammar_that_dead_ends_ends_the_output_there(engine, tokenizer, caplog):
    """After "a" this grammar allows no token: the output stops there (a stop token), instead of
    a token outside the grammar and unconstrained text after it."""
    grammar = 'root ::= "a" b\nb ::= b'
    prompt = tokenizer("Say a letter:").input_ids
    for temperature in (0.0, 1.0):
        sp = SamplingParams(max_tokens=8, temperature=temperature, seed=5, constraint=Constraint("grammar", grammar))
        engine.compile_constraint(sp)  # its first token is fine: admitted
        with caplog.at_level("WARNING", logger="pdserve.engine.structured_output"):
            r = run(engine, [("dead", prompt, sp)])[("dead", 0)]
        assert tokenizer.decode(r["ids"][:-1]) == "a" and r["ids"][-1] in engine.model_config.eos_token_ids
        assert r["finish"].value == "stop"
        assert "allows no token after 1" in caplog.text and "outside the grammar" not in caplog.text
        caplog.clear()


def test_constraints_that_do_not_compile_are_refused_naming_the_field(engine):
    for constraint, field in [
        (Constraint("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}'), "json_schema"),
        (Constraint("regex", "(unclosed"), "regex"),
        (Constraint("grammar", 'root ::= "a" |'), "grammar"),
    ]:
        with pytest.raises(
            InvalidRequest, match=rf"^sampling\.structured_output\.{field}: the grammar engine cannot compile it"
        ):
            engine.compile_constraint(SamplingParams(constraint=constraint))
