"""The OpenAI-compatible HTTP API of the router: /v1/completions, /v1/chat/completions,
/v1/models, /health (liveness) and /ready (readiness), served by uvicorn in the router's own event loop.

Every request is parsed into the router's ``CompletionRequest`` and checked by
``Completions.validate`` (off the event loop), as gRPC requests are, so both front ends
accept and reject exactly the same things; a rejection's field is renamed to the OpenAI
parameter the client sent.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
status that tells the client whether to fix the request (400, 404), back off (429, 503) or
retry later (504). A client that goes away, mid-stream or while waiting for a
non-streaming answer, cancels the generation and with it the workers' RPCs.

Beyond OpenAI's parameters, the vLLM extensions ``top_k`` (-1 or 0: off), ``ignore_eos``,
``stop_token_ids``, ``priority``, ``prompt_logprobs``, ``guided_*`` and chat's
``add_generation_prompt`` and ``continue_final_message`` are understood
(choices, logprobs, echo and structured output: ``router.openai_params``). Parameters that
would change the answer but are not implemented (penalties, ``logit_bias``, tools, ``suffix``,
and vLLM's extensions listed in ``openai_protocol``: ``min_p``, beam search, a chat template
of the client's, ...) are rejected with a 400 rather than silently ignored, unless they have their
no-op value; unknown parameters are ignored, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Any, AsyncIterator, Callable, Iterable

import anyio
import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from pdserve.request_rules import check_request_id
from pdserve.router.completions import Chunk, Completions
from pdserve.router.openai_job import Job
from pdserve.router.openai_logprobs import TokenTexts
from pdserve.router.openai_params import parity_fields
from pdserve.router.openai_protocol import (
    DONE,
    SSE_HEADERS,
    APIError,
    ClientGone,
    Params,
    chat_messages,
    chat_template_options,
    invalid,
    json_body,
    param_name,
    prompt_input,
    reject_unsupported,
    sampling_fields,
    sse,
    stream_options,
)
from pdserve.router.request import CompletionRequest
from pdserve.router.validation import InvalidRequest, ValidatedRequest
from pdserve.router.worker_errors import DispatchError
from pdserve.security import bearer_ok

log = logging.getLogger(__name__)
STREAM_LIMIT_GRACE_S = 1.0


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
    raise ClientGone()


async def _next(chunks: AsyncIterator[Chunk]) -> Chunk:
    return await chunks.__anext__()


class _EventStream(StreamingResponse):
    """An SSE response that always watches for the client going away and then cancels the
    body (Starlette only does so for ASGI servers older than spec 2.4). It lasts at most
    ``limit_s``: a client that stops reading blocks the send, out of reach of the request's
    own deadline, and would hold its in-flight slot until it hangs up."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str], limit_s: float, request_id: str) -> None:
        super().__init__(content, headers=headers)
        self.limit_s, self.request_id = limit_s, request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with anyio.move_on_after(self.limit_s) as limit:
                async with anyio.create_task_group() as group:

                    async def run_then_cancel(func: Callable) -> None:
                        with contextlib.suppress(OSError):  # the connection broke while sending
                            await func()
                        group.cancel_scope.cancel()

                    group.start_soon(run_then_cancel, partial(self.stream_response, send))
                    await run_then_cancel(partial(_wait_disconnect, receive))
            if limit.cancelled_caught:  # the server closes the connection of an unfinished response
                log.warning(
                    "request %s: its stream outlived the request time limit (the client stopped reading)",
                    self.request_id,
                )
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
        self.texts = TokenTexts(completions.tokenizer.backend)  # token id -> text, for logprobs

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "max_model_len": self.completions.tokenizer.max_model_len,
        }

    def check_model(self, p: Params) -> None:
        model = p.raw("model")
        if model is None:  # lenient: the one model served
            return
        if not isinstance(model, str):
            raise invalid("model", "must be a string")
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def validate(self, request: CompletionRequest, names: dict[str, str]) -> ValidatedRequest:
        try:
            return await self.completions.validate(request)
        except InvalidRequest as e:
            raise invalid(param_name(e.field, names), e.problem) from None

    async def handle(self, request: Request, chat: bool) -> Response:
        try:  # parsed here: a refusal is counted as validation's are
            p = await json_body(request)
            self.check_model(p)
            stream = p.get_bool("stream")
            include_usage = stream_options(p, stream)
            reject_unsupported(p, chat)
            p.get_str("user")  # accepted and ignored
            if chat:
                inputs = {"messages": chat_messages(p), **chat_template_options(p)}
                max_param = "max_completion_tokens" if p.given("max_completion_tokens") else "max_tokens"
            else:
                inputs = prompt_input(p, self.completions.tokenizer.max_model_len)
                max_param = "max_tokens"
            sampling, names = sampling_fields(p, max_param)
            parity = parity_fields(p, chat, stream)
            echo_only = parity.echo and sampling.max_tokens == 0  # legacy scoring: the prompt alone
            if echo_only:
                sampling = replace(sampling, max_tokens=1)
            completion = CompletionRequest(
                **inputs,
                request_id=request_id(request, chat),
                priority=p.get_int("priority") or 0,  # a vLLM extension: lower runs first
                sampling=replace(sampling, **parity.sampling),
            )
        except APIError as e:
            self.completions.count_invalid("not_found" if e.status == 404 else "invalid_argument")
            raise
        validated = await self.validate(completion, {**names, **parity.names})
        prompt_text = ""
        if parity.echo:  # the prompt as sent, or its ids' text, special tokens and all
            prompt_text = inputs.get("prompt") or self.completions.tokenizer.decode(
                validated.prompt_token_ids, skip_special_tokens=False
            )
        job = Job(
            self.model_name,
            chat,
            validated,
            include_usage,
            self.texts,
            parity.echo,
            prompt_text,
            parity.show_prompt_logprobs,
            echo_only,
        )
        headers = {"X-Request-Id": job.id}
        try:
            if stream:
                return await self._stream(request, job, headers)
            return await self._complete(request, job, headers)
        except DispatchError as e:
            log.info("request %s failed: %s %s", job.id, e.code.name, e.message)
            if e.code is grpc.StatusCode.INVALID_ARGUMENT and ": " in e.message:  # a worker refused a field (a grammar)
                field, problem = e.message.split(": ", 1)
                return invalid(param_name(field, {**names, **parity.names}), problem).response(headers)
            return APIError.from_dispatch(e).response(headers)
        except ClientGone:
            log.info("request %s: the client went away; generation cancelled", job.id)
            return Response(status_code=499)

    def _generation(self, job: Job) -> AsyncIterator[Chunk]:
        return self.completions.stream(job.validated, self.completions.timeout(None), prompt_only=job.echo_only)

    async def _complete(self, request: Request, job: Job, headers: dict[str, str]) -> Response:
        async def collect() -> list[Chunk]:
            async with contextlib.aclosing(self._generation(job)) as chunks:
                return [chunk async for chunk in chunks]

        return JSONResponse(job.full(await _until_disconnect(request, collect())), headers=headers)

    async def _stream(self, request: Request, job: Job, headers: dict[str, str]) -> Response:
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
                    chunk = first
                    while True:
                        for event in job.events(chunk):
                            yield event
                        if chunk.usage is not None:  # the completion's last chunk (every choice has finished)
                            break
                        chunk = await _next(chunks)
                except DispatchError as e:
                    log.info("request %s failed mid-stream: %s %s", job.id, e.code.name, e.message)
                    yield sse(APIError.from_dispatch(e).body())
                except Exception:
                    log.exception("request %s failed mid-stream", job.id)
                    yield sse(APIError(500, "internal error while streaming").body())
            yield DONE

        # Past the workers' own deadline, which ends (with an error event) a stream the client reads.
        limit_s = self.completions.request_timeout_s + STREAM_LIMIT_GRACE_S
        return _EventStream(body(), {**SSE_HEADERS, **headers}, limit_s, job.id)


class RequireToken:
    """Every /v1 call must carry the bearer token (401 otherwise). Plain ASGI, so a streamed
    answer's chunks pass straight through (an ``@app.middleware`` would relay each one
    through a memory stream and a task of its own)."""

    def __init__(self, app, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not bearer_ok(self.token, authorization):
                response = APIError(401, "missing or wrong bearer token", code="invalid_api_key").response(
                    headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def request_id(request: Request, chat: bool) -> str:
    """The client's X-Request-Id as sent (its answer's id and header, the logs' name for it), or
    a fresh one."""
    given = request.headers.get("x-request-id")
    if not given:  # absent, or empty
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        check_request_id(given)
    except InvalidRequest as e:
        raise invalid("X-Request-Id", f"the header {e.problem}") from None
    return given


def create_app(
    completions: Completions,
    model_name: str,
    extra_routes: Iterable[BaseRoute] | None = None,
    api_token: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. ``extra_routes``: Starlette routes to add (e.g. a
    ``pdserve.metrics.scrape_route(registry)``). ``api_token``: the bearer token
    every /v1 call must carry."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _OpenAI(completions, model_name)
    app.state.openai = api

    if api_token:
        app.add_middleware(RequireToken, token=api_token)

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

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:  # e.g. while it sent its body
        log.info("%s %s: the client went away", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal server error").response()

    @app.get("/health")
    async def health() -> Response:  # liveness: the router answers
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:  # readiness: 503 while a pool it needs has no healthy worker
        unready = completions.dispatcher.registry.unready_reason()
        return JSONResponse(
            {"status": "unavailable", "reason": unready} if unready else {"status": "ok"}, 503 if unready else 200
        )

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
