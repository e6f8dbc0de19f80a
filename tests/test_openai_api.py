"""The OpenAI-compatible HTTP API against a real stack (`pdserve up`, 1P1D), driven by the
official ``openai`` SDK: greedy text equals Hugging Face's, streamed or not; usage is filled;
bad input gets OpenAI-shaped 400/404 errors and the server keeps serving; a client that goes
away cancels its generation. The HTTP app runs in the test process (uvicorn in the test's
event loop) with its own ``Completions`` pointed at the stack's workers. The front end's own
logic, without workers, is tested in test_openai_frontend.py."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import grpc
import openai
import pytest

try:
    import httpx
except ImportError:  # newer openai SDKs depend on httpx2 instead
    import httpx2 as httpx

from conftest import PROMPTS
from processes import Stack

from pdserve.router.completions import Completions
from pdserve.router.dispatch import Dispatcher
from pdserve.router.http_server import http_port, serve_http
from pdserve.router.openai_api import create_app
from pdserve.router.policy import make_policy
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.workers import WorkerRegistry
from pdserve.security import SecuritySettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e
MAX_NEW = 12
CLUSTER_TOKEN = "openai-api-test"  # our own router talks to the stack's workers, which require it


@pytest.fixture(scope="module")
def stack():
    s = Stack.up("--dtype", "float32", "--kv-cache-memory", "128MiB", env={"PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN})
    yield s
    s.down()


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


async def cluster_stats(address: str) -> pb.ClusterStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pdserve_pb2_grpc.RouterStub(channel).GetClusterStats(pb.ClusterStatsRequest(), timeout=10)


@pytest.fixture(scope="module")
async def api(stack, tokenizer):
    """The HTTP app on a free loopback port, in front of the stack's workers."""
    workers = (await cluster_stats(stack.address)).workers
    registry = WorkerRegistry.connect(
        [w.address for w in workers if w.role == "prefill"],
        [w.address for w in workers if w.role != "prefill"],
        metadata=SecuritySettings(cluster_token=CLUSTER_TOKEN).cluster_metadata(),
    )
    assert registry.prefill and registry.decode
    completions = Completions(tokenizer, Dispatcher(registry, make_policy("round_robin")), 600, max_inflight=1024)
    server, task = await serve_http(create_app(completions, tokenizer.model_name), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{http_port(server)}"
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        yield SimpleNamespace(base=base, sdk=sdk, model=tokenizer.model_name, registry=registry, stack=stack)
    finally:
        await sdk.close()
        server.should_exit = True
        await task
        await registry.close()


def hf_greedy_text(hf_reference, prompt_ids: list[int], n: int = MAX_NEW) -> tuple[list[int], str]:
    ids = hf_reference.greedy(prompt_ids, n)
    return ids, hf_reference.tokenizer.decode(ids, skip_special_tokens=True)


async def wait_until_idle(api, timeout: float = 15.0) -> None:
    """No request in flight from our router, nothing running or reserved on any worker."""
    deadline = time.monotonic() + timeout
    while True:
        inflight = [w.inflight for w in api.registry.all()]
        stats = await cluster_stats(api.stack.address)
        busy = [
            (w.address, w.running, w.waiting, w.blocks_total - w.blocks_free, w.reserved_transfers)
            for w in stats.workers
            if w.running or w.waiting or w.blocks_free != w.blocks_total or w.reserved_transfers
        ]
        if not any(inflight) and not busy:
            return
        assert time.monotonic() < deadline, f"still busy: inflight={inflight} workers={busy}"
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------
async def test_completion_greedy_text_equals_transformers(api, hf_reference):
    prompt_ids = hf_reference.tokenizer(PROMPTS[0]).input_ids
    expected_ids, expected = hf_greedy_text(hf_reference, prompt_ids)
    out = await api.sdk.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == api.model
    assert abs(out.created - time.time()) < 60
    [choice] = out.choices
    assert choice.index == 0 and choice.text == expected
    assert choice.finish_reason == ("length" if len(expected_ids) == MAX_NEW else "stop")
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(expected_ids)
    assert out.usage.total_tokens == len(prompt_ids) + len(expected_ids)

    # The same prompt given as token ids (vLLM/OpenAI accept a list of ints).
    by_ids = await api.sdk.completions.create(model=api.model, prompt=prompt_ids, max_tokens=MAX_NEW, temperature=0)
    assert by_ids.choices[0].text == expected


async def test_completion_stream_equals_transformers(api, hf_reference):
    prompt_ids = hf_reference.tokenizer(PROMPTS[0]).input_ids
    expected_ids, expected = hf_greedy_text(hf_reference, prompt_ids)
    stream = await api.sdk.completions.create(
        model=api.model,
        prompt=PROMPTS[0],
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 1},
    )
    chunks = [c async for c in stream]
    *text_chunks, usage_chunk = chunks
    assert len(text_chunks) > 1 and len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert all(c.object == "text_completion" and c.model == api.model for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    finish = "length" if len(expected_ids) == MAX_NEW else "stop"
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + [finish]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        len(prompt_ids),
        len(expected_ids),
    )
    assert usage_chunk.usage.total_tokens == len(prompt_ids) + len(expected_ids)


async def test_stop_string(api, hf_reference):
    _, full = hf_greedy_text(hf_reference, hf_reference.tokenizer(PROMPTS[0]).input_ids)
    stop = full[6:10]
    out = await api.sdk.completions.create(
        model=api.model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0, stop=stop
    )
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital of Italy?"}]},
]


async def test_chat_completion_greedy(api, tokenizer, hf_reference):
    prompt_ids = tokenizer.encode_chat([MESSAGES[0], {"role": "user", "content": "What is the capital of Italy?"}])
    expected_ids, expected = hf_greedy_text(hf_reference, prompt_ids)
    out = await api.sdk.chat.completions.create(
        model=api.model, messages=MESSAGES, max_completion_tokens=MAX_NEW, temperature=0, seed=7, user="someone"
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == api.model
    [choice] = out.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), len(expected_ids))
    assert out.usage.total_tokens == len(prompt_ids) + len(expected_ids)


async def test_chat_continues_the_final_message(api, hf_reference):
    """vLLM's continue_final_message: the assistant's last message goes on, as transformers'
    template renders it (no turn closed, none opened)."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    prompt_ids = hf_reference.tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=True
    )["input_ids"]
    _, expected = hf_greedy_text(hf_reference, prompt_ids)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    out = await api.sdk.chat.completions.create(
        model=api.model, messages=messages, max_completion_tokens=MAX_NEW, temperature=0, extra_body=extra
    )
    assert out.choices[0].message.content == expected and out.usage.prompt_tokens == len(prompt_ids)
    with pytest.raises(openai.BadRequestError) as err:  # both: the turn would be closed and a new one opened
        await api.sdk.chat.completions.create(
            model=api.model,
            messages=messages,
            max_completion_tokens=2,
            extra_body={**extra, "add_generation_prompt": True},
        )
    assert err.value.body["param"] == "continue_final_message"


async def test_chat_stream_with_usage(api, tokenizer, hf_reference):
    prompt_ids = tokenizer.encode_chat([MESSAGES[0], {"role": "user", "content": "What is the capital of Italy?"}])
    expected_ids, expected = hf_greedy_text(hf_reference, prompt_ids)
    stream = await api.sdk.chat.completions.create(
        model=api.model,
        messages=MESSAGES,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected
    assert all(c.choices[0].finish_reason is None for c in body)
    assert finish.choices[0].finish_reason in ("stop", "length") and finish.choices[0].delta.content is None
    assert usage_chunk.choices == [] and all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.usage.prompt_tokens == len(prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(expected_ids)
    assert usage_chunk.usage.total_tokens == len(prompt_ids) + len(expected_ids)


# ---------------------------------------------------------------------------------------------
# Models, health, errors
# ---------------------------------------------------------------------------------------------
async def test_models_and_health(api, tokenizer):
    models = [m async for m in api.sdk.models.list()]
    assert [(m.id, m.object, m.owned_by) for m in models] == [(api.model, "model", "pdserve")]
    assert models[0].model_extra["max_model_len"] == tokenizer.max_model_len
    assert (await api.sdk.models.retrieve(api.model)).id == api.model
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200
        missing = await http.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def assert_openai_error(
    response, status: int, param: str | None = None, code: str | None = None, text: str = ""
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and text in error["message"], error
    assert error["param"] == param and error["code"] == code, error
    if status in (400, 404, 405):
        assert error["type"] == "invalid_request_error", error
    return error


async def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(api):
    good = {"model": api.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    chat = {"model": api.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=api.base, timeout=60) as http:
        post = http.post
        assert_openai_error(
            await post(
                "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}
            ),
            400,
            text="JSON",
        )
        assert_openai_error(await post("/v1/chat/completions", content=b"not json"), 400, text="JSON")
        assert_openai_error(await post("/v1/completions", json=[1, 2]), 400, text="object")
        assert_openai_error(
            await post("/v1/completions", json={**good, "model": "gpt-4"}), 404, "model", "model_not_found"
        )
        assert_openai_error(
            await post("/v1/chat/completions", json={**chat, "model": "gpt-4"}), 404, "model", "model_not_found"
        )
        error = assert_openai_error(await post("/v1/completions", json={**good, "temperature": -1}), 400, "temperature")
        assert error["message"].startswith("temperature: must be in [0,")
        assert_openai_error(await post("/v1/completions", json={**good, "temperature": "hot"}), 400, "temperature")
        assert_openai_error(await post("/v1/completions", json={**good, "top_p": 1.5}), 400, "top_p")
        assert_openai_error(await post("/v1/completions", json={**good, "max_tokens": 0}), 400, "max_tokens")
        assert_openai_error(
            await post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10**6}),
            400,
            "max_completion_tokens",
        )
        assert_openai_error(await post("/v1/completions", json={**good, "n": 0}), 400, "n")
        assert_openai_error(await post("/v1/chat/completions", json={**chat, "n": 17}), 400, "n")
        assert_openai_error(
            await post("/v1/completions", json={**good, "logprobs": 21}), 400, "logprobs", text="[0, 20]"
        )
        assert_openai_error(await post("/v1/chat/completions", json={**chat, "logprobs": "yes"}), 400, "logprobs")
        assert_openai_error(await post("/v1/completions", json={**good, "suffix": "!"}), 400, "suffix")
        assert_openai_error(
            await post("/v1/completions", json={**good, "prompt": ["a", "b"]}), 400, "prompt", text="batch"
        )
        assert_openai_error(await post("/v1/completions", json={**good, "prompt": [1, 10**8]}), 400, "prompt")
        assert_openai_error(await post("/v1/completions", json={**good, "prompt": ""}), 400, "prompt")
        assert_openai_error(
            await post("/v1/completions", json={k: v for k, v in good.items() if k != "prompt"}), 400, "prompt"
        )
        assert_openai_error(await post("/v1/completions", json={**good, "stop": [""]}), 400, "stop[0]")
        assert_openai_error(
            await post("/v1/completions", json={**good, "stream_options": {"include_usage": True}}),
            400,
            "stream_options",
        )
        assert_openai_error(await post("/v1/chat/completions", json={**chat, "messages": []}), 400, "messages")
        assert_openai_error(
            await post("/v1/chat/completions", json={**chat, "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "messages[0].role",
        )
        for name, value in [
            ("tool_choice", "required"),
            ("tool_choice", {"type": "function"}),
            ("function_call", "auto"),
        ]:
            assert_openai_error(await post("/v1/chat/completions", json={**chat, name: value}), 400, name, text="tool")
        called = [*chat["messages"], {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]
        assert_openai_error(
            await post("/v1/chat/completions", json={**chat, "messages": called}), 400, "messages[1].tool_calls"
        )
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        assert_openai_error(
            await post("/v1/chat/completions", json={**chat, "messages": image}), 400, "messages[0].content[0]"
        )
        assert_openai_error(await http.get("/v1/nothing"), 404)
        assert_openai_error(await http.get("/v1/completions"), 405)

        with pytest.raises(openai.NotFoundError):
            await api.sdk.completions.create(model="gpt-4", prompt="Hello", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as err:
            await api.sdk.chat.completions.create(model=api.model, messages=chat["messages"], temperature=-1)
        assert err.value.param == "temperature"

        # Still serving, over HTTP and through the SDK.
        response = await post("/v1/completions", json=good)
        assert response.status_code == 200 and response.json()["choices"][0]["text"]
        assert response.headers["x-request-id"] == response.json()["id"]
        # Greedy: two sampled tokens may decode to no text (a special token, half a character).
        out = await api.sdk.chat.completions.create(
            model=api.model, messages=chat["messages"], max_tokens=2, temperature=0
        )
        assert out.choices[0].message.content


async def test_the_clients_x_request_id_names_its_request(api):
    """A caller's X-Request-Id (a gateway's trace id) is the answer's id and comes back in the
    header, streamed or not; one the router cannot log is refused by name."""
    good = {"model": api.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(base_url=api.base, timeout=60) as http:
        response = await http.post("/v1/completions", json=good, headers={"X-Request-Id": "trace-42"})
        assert response.status_code == 200 and response.json()["id"] == "trace-42"
        assert response.headers["x-request-id"] == "trace-42"
        async with http.stream(
            "POST", "/v1/completions", json={**good, "stream": True}, headers={"X-Request-Id": "trace-43"}
        ) as streamed:
            assert streamed.headers["x-request-id"] == "trace-43"
            events = [line async for line in streamed.aiter_lines() if line.startswith("data: {")]
        assert events and all(json.loads(e.removeprefix("data: "))["id"] == "trace-43" for e in events)
        error = assert_openai_error(
            await http.post("/v1/completions", json=good, headers={"X-Request-Id": "x" * 500}), 400, "X-Request-Id"
        )
        assert "at most" in error["message"]
        for headers in ({}, {"X-Request-Id": ""}):  # none, or an empty one: a fresh id
            unnamed = await http.post("/v1/completions", json=good, headers=headers)
            assert unnamed.json()["id"].startswith("cmpl-") and unnamed.headers["x-request-id"] == unnamed.json()["id"]


# ---------------------------------------------------------------------------------------------
# Client disconnects cancel the generation
# ---------------------------------------------------------------------------------------------
LONG = {"prompt": PROMPTS[3], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


async def test_client_disconnect_mid_stream_cancels_the_generation(api):
    async with httpx.AsyncClient(base_url=api.base, timeout=60) as http:
        async with http.stream(
            "POST", "/v1/completions", json={"model": api.model, "stream": True, **LONG}
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break
        assert any(w.inflight for w in api.registry.decode)  # still generating when the client left
    await wait_until_idle(api)


async def test_client_giving_up_on_a_non_streaming_request_cancels_it(api):
    async with httpx.AsyncClient(base_url=api.base, timeout=2.0) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(
                "/v1/chat/completions",
                json={
                    "model": api.model,
                    "messages": [{"role": "user", "content": PROMPTS[3]}],
                    **{k: v for k, v in LONG.items() if k != "prompt"},
                },
            )
    await wait_until_idle(api)
