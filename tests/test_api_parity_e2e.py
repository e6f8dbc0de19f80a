"""API parity on real stacks (1P1D and colocated, real processes, real gRPC and KV transfer):
logprobs and prompt logprobs equal transformers' fp32 log_softmax through gRPC and through the
official ``openai`` SDK (echo + logprobs, chat logprobs); n = 4 with a seed gives four distinct,
reproducible choices, the same in both modes, from one prefill; structured output over both
APIs; ``stream_options.include_usage``; bad input gets INVALID_ARGUMENT / 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import jsonschema
import openai
import pytest
import torch
from conftest import PROMPTS
from processes import Stack
from schemas import SCHEMAS
from test_stack_e2e import assert_blocks_all_free, cluster_stats

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # a stack starts in a test's setup; the machine is shared
ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB")
TOLERANCE = 1e-4


def up(*extra: str) -> Stack:
    return Stack.up(*extra, *ARGS, "--http-port", "0")  # the cluster line says which port it took


@pytest.fixture(scope="module")
def disaggregated():
    s = up("--prefill", "1", "--decode", "1")
    yield s
    s.down()


@pytest.fixture(scope="module")
def colocated():
    s = up("--colocated")
    yield s
    s.down()


@pytest.fixture(params=["1p1d", "colocated"])
def stack(request) -> Stack:
    return request.getfixturevalue("disaggregated" if request.param == "1p1d" else "colocated")


def sdk(stack: Stack) -> openai.AsyncOpenAI:
    http = next(p["http"] for p in stack.processes if p["role"] == "router")
    return openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0, timeout=300)


def request(prompt: str, **sampling) -> pb.GenerateRequest:
    constraint = sampling.pop("structured_output", None)
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(structured_output=constraint, **sampling))


async def generate(stack: Stack, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(stack.address) as channel:
        return [m async for m in pdserve_pb2_grpc.RouterStub(channel).Generate(req, timeout=300)]


def by_choice(messages: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    choices: dict[int, list[int]] = {}
    for m in messages:
        choices.setdefault(m.index, []).extend(m.token_ids)
    return choices


def reference(hf_reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_reference.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


async def test_grpc_logprobs_and_prompt_logprobs_equal_transformers(stack, hf_reference):
    messages = await generate(stack, request(PROMPTS[2], max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2))
    prompt_ids = hf_reference.tokenizer(PROMPTS[2]).input_ids
    first = messages[0]
    assert list(first.prompt_token_ids) == prompt_ids and len(first.prompt_logprobs) == len(prompt_ids) - 1
    ids = [t for m in messages for t in m.token_ids]
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert len(logprobs) == len(ids) == 6
    ref = reference(hf_reference, prompt_ids + ids)
    for p, lp in enumerate(first.prompt_logprobs):
        assert abs(lp.logprob - ref[p, prompt_ids[p + 1]].item()) < TOLERANCE
        assert list(lp.top_logprobs) == pytest.approx(ref[p].topk(2).values.tolist(), abs=TOLERANCE)
    for k, (token_id, lp) in enumerate(zip(ids, logprobs)):
        row = ref[len(prompt_ids) - 1 + k]
        assert abs(lp.logprob - row[token_id].item()) < TOLERANCE and lp.rank == 1
        assert list(lp.top_token_ids)[0] == token_id
        assert list(lp.top_logprobs) == pytest.approx(row.topk(3).values.tolist(), abs=TOLERANCE)
    await assert_blocks_all_free(stack.address)


async def test_openai_sdk_echo_and_chat_logprobs_equal_transformers(stack, hf_reference):
    client = sdk(stack)
    model = (await client.models.list()).data[0].id
    prompt = PROMPTS[0]
    prompt_ids = hf_reference.tokenizer(prompt).input_ids
    out = await client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text and lp.text_offset[len(prompt_ids)] == len(prompt)
    ids = prompt_ids + hf_reference.greedy(prompt_ids, 4)
    ref = reference(hf_reference, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOLERANCE
        assert len(lp.top_logprobs[i]) >= 2

    # Scoring a text (echo with max_tokens 0): the prompt and its logprobs, nothing generated.
    for stream in (False, True):
        body = {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            chunks = [c async for c in await client.completions.create(**body)]
            scored = "".join(c.choices[0].text for c in chunks if c.choices)
            scored_logprobs = [
                x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
            ]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            scored_out = await client.completions.create(**body)
            scored, finish, usage = scored_out.choices[0].text, [scored_out.choices[0].finish_reason], scored_out.usage
            scored_logprobs = scored_out.choices[0].logprobs.token_logprobs
        assert scored == prompt and finish == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 0)
        assert len(scored_logprobs) == len(prompt_ids) and scored_logprobs[0] is None
        assert scored_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(prompt_ids)], abs=TOLERANCE)

    # vLLM's prompt_logprobs: the prompt token's and the 2 likeliest, by token id.
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    shown = (await client.post("/completions", body=body, cast_to=object))["choices"][0]["prompt_logprobs"]
    assert len(shown) == len(prompt_ids) and shown[0] is None
    for i in range(1, len(prompt_ids)):
        row = ref[i - 1]
        assert abs(shown[i][str(prompt_ids[i])]["logprob"] - row[prompt_ids[i]].item()) < TOLERANCE
        best = sorted(shown[i].values(), key=lambda e: e["rank"])[:2]
        assert [e["rank"] for e in best] == [1, 2]
        assert [e["logprob"] for e in best] == pytest.approx(row.topk(2).values.tolist(), abs=TOLERANCE)
    # Echoed token ids keep their special tokens, and every offset indexes the returned text.
    body = {"model": model, "prompt": [1, *prompt_ids], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0}
    choice = (await client.post("/completions", body=body, cast_to=object))["choices"][0]
    offsets, start = choice["logprobs"]["text_offset"], "<|im_start|>"
    assert choice["text"].startswith(start + prompt) and offsets == sorted(offsets)
    assert offsets[1] == len(start) and offsets[len(prompt_ids) + 1] == len(start + prompt)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    chat_ids = hf_reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    content = chat.choices[0].logprobs.content
    body = {"model": model, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    shown = (await client.post("/chat/completions", body=body, cast_to=object))["prompt_logprobs"]
    assert (
        len(shown) == len(chat_ids) and shown[0] is None and all(str(t) in e for t, e in zip(chat_ids[1:], shown[1:]))
    )
    generated = hf_reference.greedy(chat_ids, len(content))
    ref = reference(hf_reference, chat_ids + generated)
    for k, entry in enumerate(content):
        row = ref[len(chat_ids) - 1 + k]
        assert abs(entry.logprob - row[generated[k]].item()) < TOLERANCE
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOLERANCE)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    await client.close()


async def test_n4_with_a_seed_is_distinct_reproducible_and_prefilled_once(disaggregated, colocated):
    req = request("Once upon a time", max_tokens=10, temperature=1.0, seed=77, n=4, ignore_eos=True)
    before = await cluster_stats(disaggregated.address)
    first = await generate(disaggregated, req)
    after = await cluster_stats(disaggregated.address)
    choices = by_choice(first)
    assert sorted(choices) == [0, 1, 2, 3] and len({tuple(c) for c in choices.values()}) == 4
    assert all(len(c) == 10 for c in choices.values())
    assert sum(1 for m in first if m.finish_reason) == 4 and first[-1].usage.completion_tokens == 40

    def counter(stats, role, name):
        return sum(w.counters[name] for w in stats.workers if w.role == role)

    assert counter(after, "prefill", "kv_prompts_prefilled") - counter(before, "prefill", "kv_prompts_prefilled") == 1
    assert counter(after, "decode", "forks") - counter(before, "decode", "forks") == 3
    assert by_choice(await generate(disaggregated, req)) == choices, "reproducible with the seed"
    assert by_choice(await generate(colocated, req)) == choices, "the same choices colocated"
    await assert_blocks_all_free(disaggregated.address)
    await assert_blocks_all_free(colocated.address)


async def test_a_choice_that_meets_a_stop_string_ends_on_its_worker_while_the_other_runs_on(stack):
    """Stop strings are matched by the router: it ends the choice on the worker that runs it
    (before, it kept decoding, its batch slot and blocks taken, until the last choice ended)."""
    sampling = dict(max_tokens=24, temperature=1.0, seed=5, n=2, ignore_eos=True)
    free = await generate(stack, request("Once upon a time", **sampling))
    text = {i: "".join(m.text for m in free if m.index == i) for i in (0, 1)}
    stop = next(w for w in text[0].split()[1:6] if w not in text[1])  # early in choice 0, never in choice 1

    def ended(stats) -> float:
        return sum(w.counters["ended_choices"] for w in stats.workers if w.role in ("decode", "colocated"))

    before = ended(await cluster_stats(stack.address))
    stopped = await generate(stack, request("Once upon a time", stop=[stop], **sampling))
    got = {i: "".join(m.text for m in stopped if m.index == i) for i in (0, 1)}
    assert got == {0: text[0][: text[0].index(stop)], 1: text[1]}
    assert {m.index: m.finish_reason for m in stopped if m.finish_reason} == {0: "stop", 1: "length"}
    deadline = time.monotonic() + 10  # told while the other choice went on; the count follows its stats
    while ended(await cluster_stats(stack.address)) - before != 1:
        assert time.monotonic() < deadline, "the stopped choice was not ended on its worker"
        await asyncio.sleep(0.2)
    await assert_blocks_all_free(stack.address)


async def test_stream_options_include_usage_with_choices(disaggregated):
    client = sdk(disaggregated)
    model = (await client.models.list()).data[0].id
    stream = await client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=5,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, usage = {0: "", 1: ""}, None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert usage.completion_tokens == 10 and usage.prompt_tokens == 1 and all(texts.values())
    await client.close()


async def test_structured_output_over_both_apis(stack, hf_reference):
    client = sdk(stack)
    model = (await client.models.list()).data[0].id
    schema = SCHEMAS[6]  # nested objects with a pattern
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe a user as JSON."}]
    texts = [
        (
            await client.chat.completions.create(
                model=model, messages=messages, max_tokens=120, temperature=0, response_format=fmt
            )
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert texts[0] == texts[1], "greedy + schema is deterministic"
    jsonschema.validate(json.loads(texts[0]), schema)
    # At temperature 0.3 this model closes a free-form object within 200 tokens in most of its
    # draws (9 of seeds 0-11 with the hashed seeded noise) and repeats a key in the rest; seed 2
    # is a draw that closes (in 37 tokens), so the check is on the constraint's output.
    obj = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0.3, seed=2, response_format={"type": "json_object"}
    )
    content = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop", f"the object did not close within max_tokens: {content!r}"
    assert isinstance(json.loads(content), dict)
    out = await client.completions.create(
        model=model, prompt="Call me at", max_tokens=20, n=2, seed=5, extra_body={"guided_regex": r"\d{3}-\d{4}"}
    )
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) for c in out.choices)
    choice = pb.StructuredOutput(choice=pb.Choices(choices=["alpha", "beta", "gamma delta"]))
    messages_ = await generate(
        stack, request("Pick one:", max_tokens=10, temperature=1.0, seed=4, n=3, structured_output=choice)
    )
    for ids in by_choice(messages_).values():
        assert hf_reference.tokenizer.decode(ids, skip_special_tokens=True) in ("alpha", "beta", "gamma delta")
    await client.close()


@pytest.mark.parametrize(
    "sampling, field",
    [
        (dict(logprobs=21), "sampling.logprobs"),
        (dict(prompt_logprobs=-1), "sampling.prompt_logprobs"),
        (dict(n=0), "sampling.n"),
        (dict(n=17), "sampling.n"),
        (dict(n=3, best_of=2), "sampling.best_of"),
        (
            dict(structured_output=pb.StructuredOutput(json_schema='{"type": "nope"}')),
            "sampling.structured_output.json_schema",
        ),
        (
            dict(structured_output=pb.StructuredOutput(json_schema="{not json")),
            "sampling.structured_output.json_schema",
        ),
        (
            dict(structured_output=pb.StructuredOutput(json_schema='{"properties": {"a": {"$ref": "#/none"}}}')),
            "sampling.structured_output.json_schema",
        ),
        (  # the grammar engine would skip "not": refused, not answered unconstrained
            dict(structured_output=pb.StructuredOutput(json_schema='{"type": "integer", "not": {"const": 3}}')),
            "sampling.structured_output.json_schema",
        ),
        (dict(structured_output=pb.StructuredOutput(regex="(ab")), "sampling.structured_output.regex"),
        (dict(structured_output=pb.StructuredOutput(choice=pb.Choices())), "sampling.structured_output.choice"),
        (dict(structured_output=pb.StructuredOutput(json_object=True), ignore_eos=True), "sampling.ignore_eos"),
    ],
)
async def test_bad_grpc_input_is_invalid_argument_naming_the_field(disaggregated, sampling, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(disaggregated, request("Hi", max_tokens=4, **sampling))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: "), err.value.details()


async def test_a_schema_the_grammar_engine_would_skip_is_refused_saying_what(disaggregated):
    schema = '{"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true}}}'
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(
            disaggregated, request("Hi", max_tokens=4, structured_output=pb.StructuredOutput(json_schema=schema))
        )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        'sampling.structured_output.json_schema: "uniqueItems" (at #/properties/tags/uniqueItems)'
        " is not enforced by the grammar engine"
    )


@pytest.mark.parametrize(
    "chat, body, param",
    [
        (False, dict(logprobs=21), "logprobs"),
        (False, dict(n=0), "n"),
        (False, dict(n=17), "n"),
        (False, dict(best_of=3, stream=True), "best_of"),
        (False, dict(echo="yes"), "echo"),
        (True, dict(top_logprobs=3), "top_logprobs"),
        (True, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (True, dict(response_format={"type": "xml"}), "response_format.type"),
        (
            True,
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema",
        ),
        (
            True,
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}),
            "response_format",
        ),
        (
            True,
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    },
                }
            ),
            "response_format",
        ),
        (
            True,
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            ),
            "response_format",
        ),
        (True, dict(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex"),
        (False, dict(guided_choice="yes"), "guided_choice"),
    ],
)
async def test_bad_openai_input_is_a_400_naming_the_parameter(disaggregated, chat, body, param):
    client = sdk(disaggregated)
    base = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    path = "/chat/completions" if chat else "/completions"
    with pytest.raises(openai.BadRequestError) as err:
        await client.post(path, body={**base, "max_tokens": 4, **body}, cast_to=object)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(f"{param}: ")
    await client.close()
