"""The OpenAI-compatible HTTP API of the router: /v1/completions, /v1/chat/completions,
/v1/models and /health, served by uvicorn in the router's own event loop.

Every request is translated into a ``pb.GenerateRequest`` and checked by
``Completions.validate``, so the HTTP and gRPC front ends accept and reject exactly the same
things; the rejection's field name is renamed to the OpenAI parameter the client sent.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
status that tells the client whether to fix the request (400, 404), back off (429, 503) or
retry later (504). A client that goes away, mid-stream or while waiting for a
non-streaming answer, cancels the generation and with it the workers' RPCs.

Beyond OpenAI's parameters, the vLLM extensions ``top_k`` (-1 or 0: off), ``ignore_eos``,
``stop_token_ids`` and ``priority`` are understood. Parameters that would change the answer
but are not implemented (``logprobs``, ``n`` > 1, ``echo``, penalties, ``logit_bias``,
tools, structured output) are rejected with a 400 rather than silently ignored; unknown
parameters are ignored, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from functools import partial
from typing import Any, AsyncIterator, Callable, Iterable

import anyio
import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from pdserve.client import build_request
from pdserve.router.completions import Chunk, Completions, Usage
from pdserve.router.dispatch import DispatchError
from pdserve.router.validation import ValidatedRequest
from pdserve.security import bearer_ok
from pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)

INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)
FINISH_REASONS = ("stop", "length")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"

# gRPC status of a failed generation -> (HTTP status, OpenAI error type).
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_HTTP_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error"}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_dispatch(cls, error: DispatchError) -> "APIError":
        status, kind = _GRPC_TO_HTTP.get(error.code, (500, "server_error"))
        return cls(status, error.message, type=kind, code=error.code.name.lower())


def invalid(param: str | None, problem: str) -> APIError:
    """A 400 naming the parameter, in the project's ``field: problem`` style."""
    return APIError(400, f"{param}: {problem}" if param else problem, param=param)


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------
async def _json_body(request: Request) -> "_Params":
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}. "
                            "The body must be a JSON object (Content-Type: application/json).") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.")
    return _Params(data)


class _Params:
    """Typed, null-tolerant access to an OpenAI request body (null means "not given")."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def given(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def get_int(self, name: str) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid(name, f"must be an integer, got {json.dumps(value)}")
        if not INT64[0] <= value <= INT64[1]:
            raise invalid(name, f"{value} is out of range")
        return value

    def get_number(self, name: str) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid(name, f"must be a number, got {json.dumps(value)}")
        return float(value)

    def get_bool(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(name, f"must be a boolean, got {json.dumps(value)}")
        return value

    def get_str(self, name: str) -> str | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise invalid(name, f"must be a string, got {json.dumps(value)}")
        return value

    def stop(self) -> tuple[list[str] | None, bool]:
        """``stop``: a string or a list of strings; returns (strings, whether a single string was given)."""
        value = self.data.get("stop")
        if value is None:
            return None, False
        if isinstance(value, str):
            return [value], True
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value, False
        raise invalid("stop", "must be a string or a list of strings")

    def token_ids(self, name: str, value: Any) -> list[int]:
        if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise invalid(name, "must be a list of integer token ids")
        bad = next((t for t in value if not INT64[0] <= t <= INT64[1]), None)
        if bad is not None:
            raise invalid(name, f"token id {bad} is out of range")
        return value


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(p: _Params) -> dict[str, Any]:
    """/v1/completions ``prompt``: a string, a list of token ids, or a list holding one of those."""
    value = p.raw("prompt")
    if value is None:
        raise invalid("prompt", "is required")
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _token_list(value[0])):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "must not be empty")
        return {"prompt": value}
    if isinstance(value, list) and value and _token_list(value):
        return {"prompt_token_ids": p.token_ids("prompt", value)}
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str) or _token_list(v) for v in value):
        raise invalid("prompt", f"a batch of {len(value)} prompts is not supported; send one request per prompt")
    if value == []:
        raise invalid("prompt", "must not be empty")
    raise invalid("prompt", "must be a string, a list of token ids, or a list holding one of those")


def _messages(p: _Params) -> list[dict[str, str]]:
    """/v1/chat/completions ``messages``: roles system/developer/user/assistant/tool, text content."""
    value = p.raw("messages")
    if value is None:
        raise invalid("messages", "is required")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with a role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role", "is required and must be a string")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        out.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if content is None:  # e.g. an assistant message that only called tools
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") not in (None, "text"):
            raise invalid(f"{where}[{j}]", f"content parts of type {part.get('type')!r} are not supported; only text")
        else:
            raise invalid(f"{where}[{j}]", 'must be a text part: {"type": "text", "text": "..."}')
    return "\n".join(texts)  # as vLLM joins text parts


def _reject_unsupported(p: _Params, chat: bool) -> None:
    n = p.get_int("n")
    if n is not None and n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    if chat:
        if p.get_bool("logprobs"):
            raise invalid("logprobs", "log probabilities are not supported")
        if p.get_int("top_logprobs"):
            raise invalid("top_logprobs", "log probabilities are not supported")
        for name in ("tools", "functions"):
            if p.raw(name):
                raise invalid(name, "tool calling is not supported")
        fmt = p.raw("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise invalid("response_format", "only the text response format is supported")
    else:
        if p.given("logprobs"):
            raise invalid("logprobs", "log probabilities are not supported")
        if p.get_bool("echo"):
            raise invalid("echo", "echoing the prompt is not supported")
        if p.get_str("suffix"):
            raise invalid("suffix", "suffixes (insertion) are not supported")
        best_of = p.get_int("best_of")
        if best_of is not None and best_of != 1:
            raise invalid("best_of", f"only best_of=1 is supported, got {best_of}")
    for name in ("presence_penalty", "frequency_penalty"):
        if p.get_number(name):
            raise invalid(name, "penalties are not supported (only 0)")
    if p.raw("logit_bias"):
        raise invalid("logit_bias", "logit_bias is not supported")


def _stream_options(p: _Params, stream: bool) -> bool:
    """Returns stream_options.include_usage."""
    options = p.raw("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise invalid("stream_options.include_usage", "must be a boolean")
    return bool(include)


def _sampling(p: _Params, max_tokens_param: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling keyword arguments of ``build_request``, and how validation's field names
    map back to the parameters the client used."""
    top_k = p.get_int("top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    stop, single_stop = p.stop()
    stop_token_ids = p.raw("stop_token_ids")
    sampling = {
        "max_tokens": p.get_int(max_tokens_param),
        "temperature": p.get_number("temperature"),
        "top_p": p.get_number("top_p"),
        "top_k": top_k,
        "seed": p.get_int("seed"),
        "stop": stop,
        "stop_token_ids": None if stop_token_ids is None else p.token_ids("stop_token_ids", stop_token_ids),
        "ignore_eos": p.get_bool("ignore_eos"),
    }
    names = {"sampling.max_tokens": max_tokens_param, "prompt_token_ids": "prompt"}
    if single_stop:
        names["sampling.stop[0]"] = "stop"
    return sampling, names


def _param_name(field: str, names: dict[str, str]) -> str:
    if field in names:
        return names[field]
    return field.removeprefix("sampling.")


# ---------------------------------------------------------------------------------------------
# Response shapes
# ---------------------------------------------------------------------------------------------
def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def _finish(reason: str | None) -> str | None:
    if reason is None or reason in FINISH_REASONS:
        return reason
    raise DispatchError(grpc.StatusCode.INTERNAL, f"the generation ended with {reason!r}")


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Job:
    """One request on its way through the API: its id, shapes and generation."""

    def __init__(self, api: "_OpenAI", chat: bool, validated: ValidatedRequest, include_usage: bool) -> None:
        self.api = api
        self.chat = chat
        self.validated = validated
        self.id = validated.request_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.api.model_name,
                "system_fingerprint": None}

    # -- non-streaming -------------------------------------------------------------------------
    def full(self, text: str, finish: str, usage: Usage | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": []},
                      "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(usage)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": _usage(usage)}

    # -- streaming -----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None, last: bool = False) -> bytes:
        payload = {**self._head(self.object), "choices": choices}
        if self.include_usage:
            payload["usage"] = _usage(usage) if last else None
        return _sse(payload)

    def events(self, chunk: Chunk, first: bool) -> Iterable[bytes]:
        finish = _finish(chunk.finish_reason)
        if self.chat:
            if first:
                yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
            if chunk.text:
                yield self._chunk([{"index": 0, "delta": {"content": chunk.text}, "logprobs": None, "finish_reason": None}])
            if finish:
                yield self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}])
        elif chunk.text or finish:
            yield self._chunk([{"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish}])
        if finish and self.include_usage:
            yield self._chunk([], chunk.usage, last=True)


# ---------------------------------------------------------------------------------------------
# Client disconnects
# ---------------------------------------------------------------------------------------------
async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, awaitable) -> Any:
    """Awaits ``awaitable``, cancelling it (and so the workers' RPCs) if the client goes away."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone()


async def _next(chunks: AsyncIterator[Chunk]) -> Chunk:
    return await chunks.__anext__()


class _EventStream(StreamingResponse):
    """An SSE response that always watches for the client going away and then cancels the
    body (Starlette only does so for ASGI servers older than spec 2.4)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def run_then_cancel(func: Callable) -> None:
                    with contextlib.suppress(OSError):  # the connection broke while sending
                        await func()
                    group.cancel_scope.cancel()

                group.start_soon(run_then_cancel, partial(self.stream_response, send))
                await run_then_cancel(partial(_wait_disconnect, receive))
        finally:
            # A body cancelled while it waited to send is still open: close it now, which
            # closes the generation and cancels the workers' RPCs.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


# ---------------------------------------------------------------------------------------------
# The API
# ---------------------------------------------------------------------------------------------
class _OpenAI:
    def __init__(self, completions: Completions, model_name: str) -> None:
        self.completions = completions
        self.model_name = model_name
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": self.completions.tokenizer.max_model_len}

    def check_model(self, p: _Params) -> None:
        model = p.raw("model")
        if model is None:  # lenient: the one model served
            return
        if not isinstance(model, str):
            raise invalid("model", "must be a string")
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def validate(self, request: pb.GenerateRequest, names: dict[str, str]) -> ValidatedRequest:
        try:
            return self.completions.validate(request)
        except ValueError as e:
            field = getattr(e, "field", None)
            message = str(e)
            if field is None and ": " in message and message.split(": ", 1)[0].replace(".", "").isidentifier():
                field = message.split(": ", 1)[0]  # e.g. "messages: this model has no chat template"
            if field is None:
                raise invalid(None, message) from None
            param = _param_name(field, names)
            raise invalid(param, message.removeprefix(f"{field}: ")) from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):  # the chat template refused the conversation
                raise invalid("messages", f"the model's chat template rejected them: {e}") from None
            raise

    async def handle(self, request: Request, chat: bool) -> Response:
        p = await _json_body(request)
        self.check_model(p)
        stream = p.get_bool("stream")
        include_usage = _stream_options(p, stream)
        _reject_unsupported(p, chat)
        p.get_str("user")  # accepted and ignored
        if chat:
            inputs = {"messages": _messages(p)}
            max_param = "max_completion_tokens" if p.given("max_completion_tokens") else "max_tokens"
        else:
            inputs = _prompt(p)
            max_param = "max_tokens"
        sampling, names = _sampling(p, max_param)
        priority = p.get_int("priority") or 0  # a vLLM extension: lower runs first
        if not INT32[0] <= priority <= INT32[1]:
            raise invalid("priority", f"{priority} is out of range")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            grpc_request = build_request(**inputs, request_id=request_id, priority=priority, **sampling)
        except (ValueError, TypeError) as e:  # a value the wire format cannot hold
            raise invalid(None, f"invalid parameter: {e}") from None
        job = _Job(self, chat, self.validate(grpc_request, names), include_usage)
        headers = {"X-Request-Id": job.id}
        try:
            if stream:
                return await self._stream(request, job, headers)
            return await self._complete(request, job, headers)
        except DispatchError as e:
            log.info("request %s failed: %s %s", job.id, e.code.name, e.message)
            return APIError.from_dispatch(e).response(headers)
        except _ClientGone:
            log.info("request %s: the client went away; generation cancelled", job.id)
            return Response(status_code=499)

    def _generation(self, job: _Job) -> AsyncIterator[Chunk]:
        return self.completions.stream(job.validated, self.completions.timeout(None))

    async def _complete(self, request: Request, job: _Job, headers: dict[str, str]) -> Response:
        async def collect() -> tuple[str, str, Usage | None]:
            texts, last = [], None
            async with contextlib.aclosing(self._generation(job)) as chunks:
                async for chunk in chunks:
                    texts.append(chunk.text)
                    last = chunk
            return "".join(texts), _finish(last.finish_reason), last.usage

        text, finish, usage = await _until_disconnect(request, collect())
        return JSONResponse(job.full(text, finish, usage), headers=headers)

    async def _stream(self, request: Request, job: _Job, headers: dict[str, str]) -> Response:
        # The first chunk comes before the response starts, so a request that fails at once
        # (overload, no worker) still gets a proper HTTP status.
        chunks = self._generation(job)
        try:
            first = await _until_disconnect(request, _next(chunks))
        except BaseException:
            await chunks.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(chunks):
                try:
                    chunk, is_first = first, True
                    while True:
                        for event in job.events(chunk, is_first):
                            yield event
                        if chunk.finish_reason is not None:
                            break
                        chunk, is_first = await _next(chunks), False
                except DispatchError as e:
                    log.info("request %s failed mid-stream: %s %s", job.id, e.code.name, e.message)
                    yield _sse(APIError.from_dispatch(e).body())
                except Exception:
                    log.exception("request %s failed mid-stream", job.id)
                    yield _sse(APIError(500, "internal error while streaming").body())
            yield DONE

        return _EventStream(body(), headers={**SSE_HEADERS, **headers})


def create_app(completions: Completions, model_name: str, extra_routes: Iterable[BaseRoute] | None = None,
               api_token: str | None = None) -> FastAPI:
    """The OpenAI-compatible app. ``extra_routes``: Starlette routes to add (e.g. a
    ``Mount("/metrics", prometheus_client.make_asgi_app())``). ``api_token``: the bearer token
    every /v1 call must carry."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _OpenAI(completions, model_name)
    app.state.openai = api

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if api_token and request.url.path.startswith("/v1/") and not bearer_ok(api_token, request.headers.get("authorization")):
            return APIError(401, "missing or wrong bearer token", code="invalid_api_key").response(
                headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return invalid(param, first.get("msg", "invalid request")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        return APIError(exc.status_code, message).response(headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal server error").response()

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [api.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != api.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return JSONResponse(api.model_card())

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await api.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.handle(request, chat=True)

    for route in extra_routes or ():
        app.router.routes.append(route)
    return app


# ---------------------------------------------------------------------------------------------
# Serving
# ---------------------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def serve_http(app, host: str, port: int, *, graceful_shutdown_s: float = 5.0) -> tuple[uvicorn.Server, asyncio.Task]:
    """Serves ``app`` with uvicorn in the running event loop; returns once it accepts
    connections. Binding errors (port in use) raise OSError here. Stop it with
    ``server.should_exit = True`` and ``await task``; ``http_port(server)`` is the bound port
    (useful with port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(app, log_level="warning", log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=graceful_shutdown_s)
    server = _Server(config)

    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit as e:  # uvicorn exits on startup failures; never let that end the router
            raise RuntimeError(f"the HTTP server failed to start (exit code {e.code})") from None
        finally:
            sock.close()

    task = asyncio.create_task(run(), name=f"http-{host}:{port}")
    while not server.started:
        if task.done():
            task.result()  # raises why it stopped
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    return server, task


def http_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]
