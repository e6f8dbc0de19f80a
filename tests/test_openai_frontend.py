"""The front ends without workers: the OpenAI API and the gRPC servicer in front of a stub
dispatcher, with the real tokenizer. Validation runs off the event loop (a prompt that takes
long to tokenize stalls no other request); both front ends refuse bad input through the one
validation, naming the field in their own terms; worker failures map to HTTP statuses."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from collections import Counter

import grpc
import openai
import pytest

try:
    import httpx
except ImportError:  # newer openai SDKs depend on httpx2 instead
    import httpx2 as httpx

from test_openai_api import assert_openai_error

from pdserve import metrics as pdserve_metrics
from pdserve.client import build_request
from pdserve.request_rules import Constraint
from pdserve.router.completions import Completions
from pdserve.router.dispatch import TokenEvent
from pdserve.router.http_server import http_port, serve_http
from pdserve.router.openai_api import create_app
from pdserve.router.openai_logprobs import CompletionLogprobs, TokenTexts, prompt_logprobs
from pdserve.router.request import CompletionRequest, SamplingRequest
from pdserve.router.servicer import RouterService, add_router_service
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import InvalidRequest
from pdserve.router.worker_errors import DispatchError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

MAX_INFLIGHT = 64


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


class EchoDispatcher:
    """Streams the prompt's first tokens back, two per message; the last message finishes."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.seen: list = []

    async def generate(self, req, timeout_s, ends=None):
        self.seen.append(req)
        out = (req.prompt_token_ids * req.sampling.max_tokens)[: req.sampling.max_tokens]
        for i in range(0, len(out), 2):
            yield TokenEvent(out[i : i + 2], "length" if i + 2 >= len(out) else None)


class SlowTokenizer:
    """The real tokenizer, except that a prompt starting with SLOW blocks until released."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        if text.startswith("SLOW"):
            self.entered.set()
            assert self.release.wait(60), "never released"
        return self.tokenizer.encode(text)


async def _http(app):
    server, task = await serve_http(app, "127.0.0.1", 0)
    return server, task, f"http://127.0.0.1:{http_port(server)}"


async def _stop(server, task) -> None:
    server.should_exit = True
    await task


async def test_a_slow_prompt_stalls_no_other_request(tokenizer):
    """Tokenizing runs on the validation threads: while one HTTP prompt is being tokenized, the
    event loop keeps serving HTTP and gRPC requests."""
    slow = SlowTokenizer(tokenizer)
    completions = Completions(slow, EchoDispatcher(), 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    grpc_server = grpc.aio.server()
    add_router_service(RouterService(completions), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            stuck = asyncio.create_task(http.post("/v1/completions", json={"prompt": "SLOW prompt", "max_tokens": 2}))
            assert await asyncio.to_thread(slow.entered.wait, 60)
            # The slow prompt sits in the tokenizer; both front ends still answer meanwhile.
            quick = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 4
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = pdserve_pb2_grpc.RouterStub(channel)
                messages = [m async for m in stub.Generate(build_request("Hi there", max_tokens=3), timeout=60)]
            assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == 3
            assert not stuck.done()
            slow.release.set()
            assert (await stuck).status_code == 200
    finally:
        slow.release.set()
        await grpc_server.stop(None)
        await _stop(server, task)
        completions.close()


BAD = [  # (body changes, the OpenAI parameter named)
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 10**6}, "top_k"),
    ({"seed": -3}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"stop": ""}, "stop"),  # one string: named as the client sent it
    ({"stop": ["a", ""]}, "stop[1]"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"priority": 1000}, "priority"),
    ({"priority": 2**40}, "priority"),
    ({"prompt": [1, 10**8]}, "prompt"),
    ({"prompt": "word " * 9000}, "prompt"),
    ({"prompt": "x" * 1_000_001}, "prompt"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[p for _, p in BAD])
async def test_http_and_grpc_refuse_the_same_input_naming_the_field(tokenizer, change, param):
    """One validation behind both front ends: the same rule and words; only the name of the
    field differs (OpenAI's parameter vs the GenerateRequest field path)."""
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    try:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2, **change}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            error = assert_openai_error(await http.post("/v1/completions", json=body), 400, param)
        stop = body["stop"] if isinstance(body.get("stop"), list) else [body["stop"]] if "stop" in body else None
        prompt = body["prompt"]
        fields = dict(
            max_tokens=body["max_tokens"],
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            top_k=body.get("top_k"),
            seed=body.get("seed"),
            stop=stop,
            stop_token_ids=body.get("stop_token_ids"),
        )
        if "priority" in body and not -(2**31) <= body["priority"] < 2**31:
            return  # beyond what the gRPC message can carry at all
        request = (
            build_request(prompt_token_ids=prompt, priority=body.get("priority", 0), **fields)
            if isinstance(prompt, list)
            else build_request(prompt, priority=body.get("priority", 0), **fields)
        )
        with pytest.raises(InvalidRequest) as err:
            await completions.validate(CompletionRequest.from_proto(request))
        field = err.value.field
        assert field.removeprefix("sampling.") == param or (field, param) in {
            ("prompt_token_ids", "prompt"),
            ("sampling.stop[0]", "stop"),
        }
        assert error["message"] == f"{param}: {err.value.problem}"
        assert not dispatcher.seen  # refused before any worker was asked
    finally:
        await _stop(server, task)
        completions.close()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"stop_token_ids": [1] * 65 + ["x"]}, "stop_token_ids: 66 ids exceed the limit of 64"),
        ({"stop": ["a"] * 17 + [5]}, "stop: 18 stop strings exceed the limit of 16"),
        ({"guided_choice": ["a"] * 256 + [5]}, "guided_choice: must list 1 to 256 strings, got 257"),
    ],
)
async def test_a_list_past_its_limit_is_refused_before_its_items_are_read(tokenizer, change, message):
    """A body of millions of stop ids (or choices) would hold the event loop for seconds while
    each is checked: the count is checked first (the bad last item would be named otherwise)."""
    completions = Completions(tokenizer, EchoDispatcher(), 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    try:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2, **change}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            error = assert_openai_error(await http.post("/v1/completions", json=body), 400, message.split(":")[0])
        assert error["message"] == message
    finally:
        await _stop(server, task)
        completions.close()


class FailingDispatcher:
    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.tokens_before_failing = 0
        self.counters: Counter[str] = Counter()

    async def generate(self, req, timeout_s, ends=None):
        for _ in range(self.tokens_before_failing):
            yield TokenEvent([28])
        retry = 1500 if self.code is grpc.StatusCode.RESOURCE_EXHAUSTED else None
        raise DispatchError(self.code, f"injected {self.code.name}", retry_after_ms=retry)


async def test_worker_failures_map_to_http_statuses(tokenizer):
    dispatcher = FailingDispatcher()

    app = create_app(
        Completions(tokenizer, dispatcher, 600, max_inflight=1024),
        "m",
        extra_routes=[pdserve_metrics.scrape_route(pdserve_metrics.ROUTER)],  # as the router adds /metrics
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    server, task = await serve_http(app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{http_port(server)}"
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the router owns the signals
    with pytest.raises(OSError):  # a port in use fails here, and does not end the process
        await serve_http(app, "127.0.0.1", http_port(server))
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for code, status in [
                (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                (grpc.StatusCode.UNAVAILABLE, 503),
                (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
                (grpc.StatusCode.INTERNAL, 500),
            ]:
                dispatcher.code = code
                for stream in (False, True):  # a stream that fails before its first token still gets the status
                    response = await http.post("/v1/completions", json={**body, "stream": stream})
                    error = assert_openai_error(response, status, code=code.name.lower(), text=f"injected {code.name}")
                    assert error["type"] != "invalid_request_error"
                    if status == 429:  # the hint the SDK waits by, in its two spellings
                        assert (response.headers["retry-after-ms"], response.headers["retry-after"]) == ("1500", "2")
                    elif status != 429:
                        assert "retry-after" not in response.headers

            # Refused while parsing (before validation): counted like validation's refusals.
            def rejected(reason: str) -> float:
                value = pdserve_metrics.ROUTER.get_sample_value("pdserve_request_rejections_total", {"reason": reason})
                return value or 0.0

            invalid, unknown = rejected("invalid_argument"), rejected("not_found")
            assert (await http.post("/v1/chat/completions", json={"messages": []})).status_code == 400
            assert (await http.post("/v1/completions", json={**body, "model": "other"})).status_code == 404
            assert (rejected("invalid_argument"), rejected("not_found")) == (invalid + 1, unknown + 1)

            scrape = await http.get("/metrics")  # that path itself, not a redirect to /metrics/
            assert scrape.status_code == 200 and 'pdserve_request_rejections_total{reason="unavailable"}' in scrape.text

            # Failing mid-stream: an error event, then [DONE]; the SDK raises it.
            dispatcher.code, dispatcher.tokens_before_failing = grpc.StatusCode.UNAVAILABLE, 2
            response = await http.post("/v1/completions", json={**body, "stream": True})
            assert response.status_code == 200
            events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
            assert '"error"' in events[-2] and "injected UNAVAILABLE" in events[-2] and events[-1] == "[DONE]"
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as sdk:
            stream = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], stream=True
            )
            with pytest.raises(openai.APIError, match="injected UNAVAILABLE"):
                async for _ in stream:
                    pass
    finally:
        server.should_exit = True
        await task


async def test_hostile_bodies_get_4xx_naming_the_problem(tokenizer, monkeypatch):
    """Deep nesting, numbers past any float and oversized bodies: clear 4xx answers, never a 500."""
    from pdserve.router import openai_protocol

    monkeypatch.setattr(openai_protocol, "MAX_BODY_BYTES", 1 << 16)
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    deep_schema = '{"type": "array", "items": ' * 200 + "{}" + "}" * 200
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            answer = await http.post("/v1/completions", content=b"[" * 100_000)
            assert answer.status_code == 413  # past the (lowered) body limit before any parsing
            answer = await http.post("/v1/completions", content=b"[" * 20_000)
            assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"]
            body = b'{"model": "m", "prompt": "Hi", "temperature": 1' + b"0" * 400 + b"}"
            assert_openai_error(await http.post("/v1/completions", content=body), 400, "temperature")
            for name, value in (("min_p", 0.1), ("repetition_penalty", 1.3), ("min_tokens", 5)):
                unsupported = {"model": "m", "prompt": "Hi", "max_tokens": 2, name: value}
                assert_openai_error(await http.post("/v1/completions", json=unsupported), 400, name)
            no_ops = {"model": "m", "prompt": "Hi", "max_tokens": 2, "min_p": 0, "repetition_penalty": 1.0}
            assert (await http.post("/v1/completions", json=no_ops)).status_code == 200
            nested = {"model": "m", "prompt": "Hi", "max_tokens": 2, "guided_json": deep_schema}
            error = assert_openai_error(await http.post("/v1/completions", json=nested), 400, "guided_json")
            assert "nested more than" in error["message"]
            # A lone surrogate (legal JSON, no legal text): refused naming where it is.
            for body, param in [
                (b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
                (b'{"model": "\\udfff", "prompt": "Hi"}', "model"),
                (b'{"model": "m", "prompt": "Hi", "guided_choice": ["a", "x\\ud800"]}', "guided_choice[1]"),
                (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
            ]:
                url = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
                assert_openai_error(await http.post(url, content=body), 400, param, text="lone surrogate")
            pair = b'{"model": "m", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'  # a pair is one character
            assert (await http.post("/v1/completions", content=pair)).status_code == 200
            path = b'{"model": "m", "prompt": "C:\\\\udata", "max_tokens": 2}'  # a backslash, then "udata"
            assert (await http.post("/v1/completions", content=path)).status_code == 200
            utf16 = '{"model": "m", "prompt": "\\ud800"}'.encode("utf-16")  # json.loads would guess the encoding
            assert_openai_error(await http.post("/v1/completions", content=utf16), 400, text="UTF-8")
        assert (
            len(dispatcher.seen) == 3
        )  # only the requests with no-op settings, a pair and a backslash reached a worker
    finally:
        await _stop(server, task)
        completions.close()


async def test_sizes_are_judged_before_a_list_is_walked(tokenizer):
    """A list of ids or messages too long for any answer is refused by its length, before its
    elements are checked one by one (millions of them held the event loop for seconds)."""
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    too_many = tokenizer.max_model_len + 10
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            for prompt in ([1] * too_many + ["x"], [[1] * too_many + ["x"]]):
                answer = await http.post("/v1/completions", json={"model": "m", "prompt": prompt})
                error = assert_openai_error(answer, 400, "prompt")
                assert f"{too_many + 1} tokens leave no room" in error["message"], error
            answer = await http.post("/v1/chat/completions", json={"model": "m", "messages": [1] * 600})
            error = assert_openai_error(answer, 400, "messages")
            assert "600 messages exceed the limit" in error["message"], error
            for batch in (["a", "b"] * 10_000, [[1] * too_many, [1] * too_many + ["x"]]):
                answer = await http.post("/v1/completions", json={"model": "m", "prompt": batch})
                assert f"a batch of {len(batch)} prompts" in assert_openai_error(answer, 400, "prompt")["message"]
        assert not dispatcher.seen
    finally:
        await _stop(server, task)
        completions.close()


class EndlessDispatcher:
    """Streams long-text tokens until it is closed."""

    def __init__(self, token_id: int) -> None:
        self.counters: Counter[str] = Counter()
        self.token_id = token_id

    async def generate(self, req, timeout_s, ends=None):
        for _ in range(100_000):
            yield TokenEvent([self.token_id] * 64)
            await asyncio.sleep(0)


async def test_a_stream_its_client_stops_reading_ends_at_the_request_time_limit(tokenizer, caplog):
    """A send blocked on a client that reads nothing is out of reach of the workers' deadline: the
    stream itself ends at the request time limit, freeing its in-flight slot."""
    special = set(tokenizer.hf.all_special_ids)
    token_id = max(
        (i for i in tokenizer.hf.get_vocab().values() if i not in special), key=lambda i: len(tokenizer.decode([i]))
    )
    completions = Completions(tokenizer, EndlessDispatcher(token_id), 1.5, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    host, port = base.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "m", "prompt": "Hi", "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        for _ in range(200):  # the stream starts, then fills the socket buffers and blocks
            await asyncio.sleep(0.1)
            if completions.inflight == 1:
                break
        assert completions.inflight == 1
        for _ in range(300):  # bounded: 30 s
            await asyncio.sleep(0.1)
            if completions.inflight == 0:
                break
        assert completions.inflight == 0, "the stream outlived its time limit"
        assert completions.counters["cancelled"] == 1
        assert any("outlived the request time limit" in r.getMessage() for r in caplog.records)
    finally:
        sock.close()
        await _stop(server, task)
        completions.close()


async def test_a_client_gone_while_sending_its_body_is_no_server_error(tokenizer, caplog):
    caplog.set_level(logging.INFO)
    completions = Completions(tokenizer, EchoDispatcher(), 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    try:
        port = http_port(server)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b'{"prompt": "Hi"')
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()  # 485 bytes short
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            ok = {"model": "m", "prompt": "Hi", "max_tokens": 2}
            for _ in range(50):  # until the server has seen the disconnect
                if "the client went away" in caplog.text:
                    break
                await asyncio.sleep(0.05)
            assert (await http.post("/v1/completions", json=ok)).status_code == 200
        assert "the client went away" in caplog.text
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    finally:
        await _stop(server, task)
        completions.close()


@pytest.mark.parametrize("prompt", ["Hello, and the", "😀 is é€ and 中文 ok", "<|im_start|>user\nHi 👋🏽"])
def test_completion_text_offsets_index_the_returned_text(tokenizer, prompt):
    """Each token's offset is where its text starts in the returned text: tokens that split a
    character share its offset, offsets never go back, and special tokens count where the text
    holds them (an echoed prompt) and take no room where it leaves them out (a completion)."""
    texts = TokenTexts(tokenizer.backend)
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    offsets = CompletionLogprobs(texts).block(ids, [None] * len(ids), echoed=prompt)["text_offset"]
    expected = [len(bytes(b for t in ids[:i] for b in texts(t)[1]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert offsets == expected and offsets == sorted(offsets) and offsets[-1] < len(prompt)
    for i, token_id in enumerate(ids):
        if texts(token_id)[0].isprintable() and "\ufffd" not in texts(token_id)[0]:  # a whole character or more
            assert prompt[offsets[i] :].startswith(texts(token_id)[0]), (i, texts(token_id)[0])
    with_bos = [0, *ids]  # a tokenizer that adds a BOS the text prompt does not hold: it takes no room
    bos_offsets = CompletionLogprobs(texts).block(with_bos, [None] * len(with_bos), echoed=prompt)["text_offset"]
    assert bos_offsets == [0, *offsets]
    completion = CompletionLogprobs(texts)
    completion.restart_at(len(prompt))
    generated = [*tokenizer.encode(" a"), 2, *tokenizer.encode(" b")]  # <|im_end|> between: not in the text
    assert completion.block(generated, [None] * 3)["text_offset"] == [len(prompt), len(prompt) + 2, len(prompt) + 2]


def test_prompt_logprobs_take_vllm_shape(tokenizer):
    texts = TokenTexts(tokenizer.backend)
    ids = tokenizer.encode("Hello world")
    world, other = ids[1], tokenizer.encode(" there")[0]
    lp = pb.TokenLogprob(logprob=-2.5, rank=3, top_token_ids=[other, 28], top_logprobs=[-0.5, -1.0])
    assert prompt_logprobs(texts, ids, [lp]) == [
        None,
        {
            str(other): {"logprob": -0.5, "rank": 1, "decoded_token": " there"},
            "28": {"logprob": -1.0, "rank": 2, "decoded_token": ","},
            str(world): {"logprob": -2.5, "rank": 3, "decoded_token": " world"},
        },
    ]


@pytest.mark.parametrize(
    "chat, body, param",
    [
        (False, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (False, {"use_beam_search": True}, "use_beam_search"),
        (False, {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        (False, {"skip_special_tokens": False}, "skip_special_tokens"),
        (False, {"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
        (False, {"add_special_tokens": False}, "add_special_tokens"),
        (False, {"bad_words": ["x"]}, "bad_words"),
        (True, {"echo": True}, "echo"),
        (True, {"chat_template": "{{ messages }}"}, "chat_template"),
    ],
)
async def test_vllm_parameters_that_would_change_the_answer_are_refused_not_ignored(tokenizer, chat, body, param):
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    base_body = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    url = "/v1/chat/completions" if chat else "/v1/completions"
    no_ops = {"use_beam_search": False, "length_penalty": 1, "skip_special_tokens": True, "bad_words": []}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            answer = await http.post(url, json={"model": "m", "max_tokens": 2, **base_body, **body})
            assert_openai_error(answer, 400, param)
            answer = await http.post(url, json={"model": "m", "max_tokens": 2, **base_body, **no_ops})
            assert answer.status_code == 200, answer.text
        assert len(dispatcher.seen) == 1  # only the no-op request reached a worker
    finally:
        await _stop(server, task)
        completions.close()


async def test_a_continued_final_message_reaches_the_workers_as_transformers_renders_it(tokenizer):
    """continue_final_message (both front ends): the worker gets the template's rendering with
    the assistant's last message left open; without messages, or with add_generation_prompt
    true, or with a last message not the assistant's, it is refused naming the field."""
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    grpc_server = grpc.aio.server()
    add_router_service(RouterService(completions), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! My name"}]
    continued = tokenizer.hf.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=True)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            body = {"model": "m", "messages": messages, "max_tokens": 2, "continue_final_message": True}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            assert list(dispatcher.seen[-1].prompt_token_ids) == continued["input_ids"]
            both = {**body, "add_generation_prompt": True}
            assert_openai_error(await http.post("/v1/chat/completions", json=both), 400, "continue_final_message")
            user_last = {**body, "messages": messages[:1]}
            assert_openai_error(await http.post("/v1/chat/completions", json=user_last), 400, "continue_final_message")
            closed = {"model": "m", "messages": messages, "max_tokens": 2, "add_generation_prompt": False}
            assert (await http.post("/v1/chat/completions", json=closed)).status_code == 200
            assert tokenizer.hf.decode(dispatcher.seen[-1].prompt_token_ids).endswith("Hello! My name<|im_end|>\n")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            request = pb.GenerateRequest(
                messages=chat, continue_final_message=True, sampling=pb.SamplingParams(max_tokens=2)
            )
            assert [m async for m in stub.Generate(request, timeout=60)][-1].finish_reason == "length"
            assert list(dispatcher.seen[-1].prompt_token_ids) == continued["input_ids"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                prompt = pb.GenerateRequest(prompt="Hi", add_generation_prompt=False)
                await stub.Generate(prompt, timeout=60).read()
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "add_generation_prompt: applies to messages only"
    finally:
        await grpc_server.stop(None)
        await _stop(server, task)
        completions.close()


async def test_a_request_the_client_leaves_is_counted_as_cancelled_and_one_it_reads_to_the_end_is_not(tokenizer):
    completions = Completions(tokenizer, EchoDispatcher(), 600, max_inflight=MAX_INFLIGHT)
    try:
        req = await completions.validate(
            CompletionRequest(prompt="Hello there, friend", sampling=SamplingRequest(max_tokens=8))
        )
        before = pdserve_metrics.ROUTER.get_sample_value("pdserve_requests_total", {"finish_reason": "cancelled"}) or 0
        left = completions.stream(req, 60)
        await left.__anext__()
        await left.aclose()  # the client went away after its first chunk
        async for chunk in completions.stream(req, 60):
            if chunk.usage is not None:
                break  # the last chunk read, then the stream closed: finished, not cancelled
        assert completions.counters["cancelled"] == 1 and completions.counters["finished_length"] == 1
        after = pdserve_metrics.ROUTER.get_sample_value("pdserve_requests_total", {"finish_reason": "cancelled"})
        assert after == before + 1
    finally:
        completions.close()


class StopTokenDispatcher:
    """Streams ``script`` (lists of ids); the last message finishes with ``finish``: ``stop`` as a
    worker does when it samples one of the request's stop_token_ids."""

    def __init__(self, script: list[list[int]], finish: str = "stop") -> None:
        self.script, self.finish, self.counters = script, finish, Counter()

    async def generate(self, req, timeout_s, ends=None):
        for k, ids in enumerate(self.script):
            yield TokenEvent(ids, self.finish if k == len(self.script) - 1 else None)


async def test_a_stop_token_ends_the_text_without_its_own_text_and_stays_in_the_token_ids(tokenizer):
    words, period = tokenizer.encode(" with a brown bear"), tokenizer.encode(".")
    completions = Completions(tokenizer, StopTokenDispatcher([words[:2], [*words[2:], *period]]), 600, MAX_INFLIGHT)
    try:
        req = await completions.validate(
            CompletionRequest(prompt="The fox", sampling=SamplingRequest(max_tokens=16, stop_token_ids=tuple(period)))
        )
        chunks = [chunk async for chunk in completions.stream(req, 60)]
        assert "".join(c.text for c in chunks) == " with a brown bear"  # vLLM drops the stop token's text
        assert [t for c in chunks for t in c.token_ids] == [*words, *period]  # and keeps its id
        assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(words) + 1
    finally:
        completions.close()


@pytest.mark.parametrize("stop", [(), ("\ufffd",)], ids=["no-stop", "stop"])
async def test_an_output_ending_in_a_real_replacement_character_shows_it_or_stops_at_it(tokenizer, stop):
    """The incremental decoder holds back a trailing U+FFFD; the last message releases it, or
    ends the text at it when it is a stop string."""
    words, replacement = tokenizer.encode(" odd"), 24211  # SmolLM2's token for U+FFFD itself
    completions = Completions(tokenizer, StopTokenDispatcher([words, [replacement]], "length"), 600, MAX_INFLIGHT)
    try:
        sampling = SamplingRequest(max_tokens=len(words) + 1, stop=stop)
        req = await completions.validate(CompletionRequest(prompt="An", sampling=sampling))
        chunks = [chunk async for chunk in completions.stream(req, 60)]
        text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        assert (text, finish) == ((" odd", "stop") if stop else (" odd\ufffd", "length"))
    finally:
        completions.close()


class StopInChoiceZeroDispatcher:
    """n = 2: choice 0 writes a stop string in its second message while choice 1 goes on."""

    def __init__(self, tokenizer) -> None:
        self.counters, self.ends = Counter(), None
        self.script = [(0, " one."), (1, " two"), (0, " more"), (1, " three"), (1, " four")]
        self.ids = [tokenizer.encode(text) for _, text in self.script]
        self.ended_when: list[set[int]] = []  # the choices ended by the time each message went out

    async def generate(self, req, timeout_s, ends=None):
        self.ends = ends
        for (index, _), ids in zip(self.script, self.ids):
            self.ended_when.append(set(ends.ended))
            yield TokenEvent(ids, "length" if (index, ids) == (1, self.ids[-1]) else None, index=index)


async def test_a_choice_that_meets_a_stop_string_is_ended_where_it_runs_while_the_other_goes_on(tokenizer):
    dispatcher = StopInChoiceZeroDispatcher(tokenizer)
    completions = Completions(tokenizer, dispatcher, 600, MAX_INFLIGHT)
    try:
        sampling = SamplingRequest(max_tokens=16, n=2, stop=(".",))
        req = await completions.validate(CompletionRequest(prompt="Count", sampling=sampling))
        chunks = [chunk async for chunk in completions.stream(req, 60)]
        text = {i: "".join(c.text for c in chunks if c.index == i) for i in (0, 1)}
        assert text == {0: " one", 1: " two three four"}
        assert dispatcher.ended_when == [set(), {0}, {0}, {0}, {0}]  # told once choice 0 stopped
    finally:
        completions.close()


class TwoChoicesDispatcher:
    """Two choices whose messages arrive together each step, 50 ms apart: as n = 2 streams."""

    def __init__(self) -> None:
        self.counters = Counter()

    async def generate(self, req, timeout_s, ends=None):
        for step in range(3):
            if step:
                await asyncio.sleep(0.05)
            for index in (0, 1):
                yield TokenEvent([28], "length" if step == 2 else None, index=index)


async def test_inter_token_latency_times_each_choice_against_itself(tokenizer):
    from pdserve import metrics as pdserve_metrics

    def itl() -> tuple[float, float]:
        get = pdserve_metrics.ROUTER.get_sample_value
        return get("pdserve_inter_token_latency_seconds_count") or 0, get(
            "pdserve_inter_token_latency_seconds_sum"
        ) or 0

    completions = Completions(tokenizer, TwoChoicesDispatcher(), 600, MAX_INFLIGHT)
    try:
        req = await completions.validate(
            CompletionRequest(prompt="Hi", sampling=SamplingRequest(max_tokens=3, n=2, ignore_eos=True))
        )
        (count, total) = itl()
        chunks = [chunk async for chunk in completions.stream(req, 60)]
        assert sum(len(c.token_ids) for c in chunks) == 6
        (count2, total2) = itl()
        assert count2 - count == 4  # two gaps per choice, none between the choices of one step
        assert (total2 - total) / 4 >= 0.045  # each about the 50 ms between steps
    finally:
        completions.close()


class RankedChoicesDispatcher:
    """Three choices of 2, 3 and 4 tokens; the second is the most likely (best_of keeps it)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    async def generate(self, req, timeout_s, ends=None):
        for index, (length, logprob) in enumerate(((2, -1.0), (3, -0.1), (4, -2.0))):
            logprobs = [pb.TokenLogprob(logprob=logprob, rank=1)] * length
            yield TokenEvent([28] * length, "length", index=index, logprobs=logprobs)


def _generated() -> float:
    return pdserve_metrics.ROUTER.get_sample_value("pdserve_generation_tokens_total") or 0


async def test_best_of_counts_the_tokens_of_the_choices_returned_only(tokenizer):
    completions = Completions(tokenizer, RankedChoicesDispatcher(), 600, MAX_INFLIGHT)
    try:
        req = await completions.validate(
            CompletionRequest(prompt="Hi", sampling=SamplingRequest(max_tokens=4, n=1, best_of=3, ignore_eos=True))
        )
        before = _generated()
        chunks = [chunk async for chunk in completions.stream(req, 60)]
        assert [len(c.token_ids) for c in chunks] == [3]  # the most likely choice
        assert chunks[-1].usage.completion_tokens == 3
        assert _generated() - before == 3
    finally:
        completions.close()


async def test_echo_with_no_new_tokens_counts_no_generated_token(tokenizer):
    completions = Completions(tokenizer, TwoChoicesDispatcher(), 600, MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    try:
        body = {"model": "m", "prompt": "Hello there", "max_tokens": 0, "echo": True, "n": 2}
        before = _generated()
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 0
        assert [c["text"] for c in answer.json()["choices"]] == ["Hello there"] * 2
        assert _generated() == before
        body["max_tokens"] = 3  # the same with new tokens: six of them, counted
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            answer = await http.post("/v1/completions", json=body)
        assert answer.json()["usage"]["completion_tokens"] == 6
        assert _generated() - before == 6
    finally:
        await _stop(server, task)
        completions.close()


async def test_vllm_structured_outputs_reach_the_workers_as_constraints(tokenizer):
    """vLLM's current form (``structured_outputs``, since v0.12) constrains as its older
    ``guided_*`` parameters do; what it cannot honour is refused, never ignored."""
    dispatcher = EchoDispatcher()
    completions = Completions(tokenizer, dispatcher, 600, max_inflight=MAX_INFLIGHT)
    server, task, base = await _http(create_app(completions, "m"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:

            async def post(**fields):
                return await http.post(
                    "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2, **fields}
                )

            for options, expected in (
                ({"choice": ["yes", "no"]}, Constraint("choice", choices=("yes", "no"))),
                ({"json": schema}, Constraint("json_schema", json.dumps(schema))),
                ({"regex": "[0-9]{3}", "disable_fallback": False}, Constraint("regex", "[0-9]{3}")),
                ({"grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
                ({"json_object": True}, Constraint("json_object")),
            ):
                answer = await post(structured_outputs=options)
                assert answer.status_code == 200, answer.text
                assert dispatcher.seen[-1].sampling.constraint == expected
            seen = len(dispatcher.seen)
            for fields, param in (
                ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
                ({"structured_outputs": {}}, "structured_outputs"),
                ({"structured_outputs": ["a"]}, "structured_outputs"),
                ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
                ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
                ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
                ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
            ):
                assert_openai_error(await post(**fields), 400, param)
            assert len(dispatcher.seen) == seen
    finally:
        await _stop(server, task)
        completions.close()
