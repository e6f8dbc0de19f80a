"""OpenAI request bodies and response shapes: parsing a /v1 request into the router's
``CompletionRequest`` (the one request model both front ends share, so the one validation
applies), the error type and its mapping from gRPC status codes, and the JSON objects and SSE
frames sent back."""

from __future__ import annotations

import json
from typing import Any

import grpc
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from pdserve.request_rules import (
    InvalidRequest,
    check_message_count,
    check_prompt_length,
    check_stop_count,
    check_stop_token_id_count,
)
from pdserve.router.completions import Usage
from pdserve.router.json_text import has_lone_surrogate_escape, lone_surrogate_path
from pdserve.router.request import ChatMessage, SamplingRequest
from pdserve.router.worker_errors import DispatchError

INT64 = (-(2**63), 2**63 - 1)  # JSON integers beyond this are refused while parsing
FINISH_REASONS = ("stop", "length")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"

# gRPC status of a failed generation -> (HTTP status, OpenAI error type).
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    # The cluster's own mismatch (two workers refusing each other's KV handshake), not the request's.
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_HTTP_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms  # a 429's hint, sent as headers the OpenAI SDK honours
        self.status = status
        self.message = message
        self.type = type or _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.retry_after_ms:
            seconds = -(-self.retry_after_ms // 1000)  # Retry-After is whole seconds, rounded up
            headers = {**(headers or {}), "retry-after-ms": str(self.retry_after_ms), "Retry-After": str(seconds)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_dispatch(cls, error: DispatchError) -> "APIError":
        status, kind = _GRPC_TO_HTTP.get(error.code, (500, "server_error"))
        return cls(status, error.message, type=kind, code=error.code.name.lower(), retry_after_ms=error.retry_after_ms)


def invalid(param: str | None, problem: str) -> APIError:
    """A 400 naming the parameter, in the project's ``field: problem`` style."""
    return APIError(400, f"{param}: {problem}" if param else problem, param=param)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------
MAX_BODY_BYTES = 16 << 20  # a request body: the largest valid one (a 1M-character prompt, escaped) fits


async def json_body(request: Request) -> "Params":
    raw = await read_body(request)
    try:
        text = raw.decode("utf-8")  # JSON between systems is UTF-8 (RFC 8259), not a guessed UTF-16/32
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(
            400,
            f"We could not parse the JSON body of your request: {e}. "
            "The body must be a JSON object in UTF-8 (Content-Type: application/json).",
        ) from None
    except RecursionError:
        raise APIError(400, "The JSON body of your request is nested too deeply.") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.")
    if has_lone_surrogate_escape(text):
        raise invalid(
            lone_surrogate_path(data), "not valid Unicode: a lone surrogate (\\ud800-\\udfff) that no text can hold"
        )
    return Params(data)


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 past ``MAX_BODY_BYTES`` before more of it is held."""
    too_large = APIError(413, f"The request body exceeds {MAX_BODY_BYTES} bytes.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(parts)


class Params:
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
        try:
            return float(value)
        except OverflowError:  # an integer past any float
            raise invalid(name, "is out of range") from None

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
        if isinstance(value, list):
            by_rule(check_stop_count, len(value), field="stop")  # before walking a list of millions
            if all(isinstance(s, str) for s in value):
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


def prompt_input(p: Params, max_model_len: int) -> dict[str, Any]:
    """/v1/completions ``prompt``: a string, a list of token ids, or a list holding one of
    those; returns the ``CompletionRequest`` field it fills."""
    value = p.raw("prompt")
    if value is None:
        raise invalid("prompt", "is required")
    if isinstance(value, list) and len(value) > 1 and isinstance(value[0], (list, str)):  # before walking them
        raise invalid("prompt", f"a batch of {len(value)} prompts is not supported; send one request per prompt")
    ids = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
    if isinstance(ids, list) and ids and isinstance(ids[0], int):  # a list of ids: its length first
        by_rule(check_prompt_length, len(ids), max_model_len=max_model_len, field="prompt")
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _token_list(value[0])):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "must not be empty")
        return {"prompt": value}
    if isinstance(value, list) and value and _token_list(value):
        return {"prompt_token_ids": tuple(p.token_ids("prompt", value))}
    if value == []:
        raise invalid("prompt", "must not be empty")
    raise invalid("prompt", "must be a string, a list of token ids, or a list holding one of those")


def chat_messages(p: Params) -> tuple[ChatMessage, ...]:
    """/v1/chat/completions ``messages``: roles system/developer/user/assistant/tool, text content."""
    value = p.raw("messages")
    if value is None:
        raise invalid("messages", "is required")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    by_rule(check_message_count, len(value))
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
        for name in ("tool_calls", "function_call"):
            if message.get(name):  # the template would render the turn without them
                raise invalid(f"{where}.{name}", "tool calls are not supported")
        out.append(ChatMessage(role, _content(message.get("content"), f"{where}.content")))
    return tuple(out)


def by_rule(check, *args, **kwargs) -> None:
    """A shared request rule, its refusal as a 400."""
    try:
        check(*args, **kwargs)
    except InvalidRequest as e:
        raise invalid(e.field, e.problem) from None


def chat_template_options(p: Params) -> dict[str, Any]:
    """vLLM's ``add_generation_prompt`` and ``continue_final_message`` (the ``CompletionRequest``
    fields they fill; validation judges them together)."""
    options: dict[str, Any] = {"continue_final_message": p.get_bool("continue_final_message")}
    if p.given("add_generation_prompt"):
        options["add_generation_prompt"] = p.get_bool("add_generation_prompt")
    return options


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


# vLLM's extensions that would change the answer and are not built: refused unless null, empty
# or their no-op value (None: no value is a no-op).
_NOT_BUILT = (
    ("min_p", 0.0),
    ("repetition_penalty", 1.0),
    ("min_tokens", 0),
    ("use_beam_search", False),
    ("include_stop_str_in_output", False),
    ("skip_special_tokens", True),
    ("return_tokens_as_token_ids", False),
    ("truncate_prompt_tokens", None),
    ("bad_words", None),
    ("allowed_token_ids", None),
    ("guided_whitespace_pattern", None),
    ("logits_processors", None),
)
_NOT_BUILT_CHAT = (
    ("echo", False),
    ("add_special_tokens", False),
    ("chat_template", None),
    ("chat_template_kwargs", None),
    ("documents", None),
)
_NOT_BUILT_COMPLETIONS = (("add_special_tokens", True),)


def reject_unsupported(p: Params, chat: bool) -> None:
    if chat:
        for name in ("tools", "functions", "function_call"):
            if p.raw(name):
                raise invalid(name, "tool calling is not supported")
        if p.raw("tool_choice") not in (None, "none", "auto"):  # with no tools, "auto" calls none
            raise invalid("tool_choice", 'tool calling is not supported (only "none" or "auto")')
    elif p.get_str("suffix"):
        raise invalid("suffix", "suffixes (insertion) are not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if p.get_number(name):
            raise invalid(name, "penalties are not supported (only 0)")
    if p.raw("logit_bias"):
        raise invalid("logit_bias", "logit_bias is not supported")
    for name, no_op in (*_NOT_BUILT, *(_NOT_BUILT_CHAT if chat else _NOT_BUILT_COMPLETIONS)):
        if not _is_no_op(p.raw(name), no_op):
            raise invalid(name, "is not supported" + (f" (only {json.dumps(no_op)})" if no_op is not None else ""))


def _is_no_op(value: Any, no_op: Any) -> bool:
    if value is None or value == [] or value == {}:
        return True
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, no_op))
    return (numbers or type(value) is type(no_op)) and value == no_op


def stream_options(p: Params, stream: bool) -> bool:
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


def sampling_fields(p: Params, max_tokens_param: str) -> tuple[SamplingRequest, dict[str, str]]:
    """The sampling the client asked for, and how validation's field names map back to the
    parameters the client used."""
    top_k = p.get_int("top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    stop, single_stop = p.stop()
    stop_token_ids = p.raw("stop_token_ids")
    if isinstance(stop_token_ids, list):
        by_rule(check_stop_token_id_count, len(stop_token_ids), field="stop_token_ids")  # before walking them
    sampling = SamplingRequest(
        max_tokens=p.get_int(max_tokens_param),
        temperature=p.get_number("temperature"),
        top_p=p.get_number("top_p"),
        top_k=top_k,
        seed=p.get_int("seed"),
        stop=tuple(stop or ()),
        stop_token_ids=() if stop_token_ids is None else tuple(p.token_ids("stop_token_ids", stop_token_ids)),
        ignore_eos=p.get_bool("ignore_eos"),
    )
    names = {"sampling.max_tokens": max_tokens_param, "prompt_token_ids": "prompt"}
    if single_stop:
        names["sampling.stop[0]"] = "stop"
    return sampling, names


def param_name(field: str, names: dict[str, str]) -> str:
    if field in names:
        return names[field]
    return field.removeprefix("sampling.")


# ---------------------------------------------------------------------------------------------
# Response shapes
# ---------------------------------------------------------------------------------------------
def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def openai_finish_reason(reason: str | None) -> str | None:
    if reason is None or reason in FINISH_REASONS:
        return reason
    raise DispatchError(grpc.StatusCode.INTERNAL, f"the generation ended with {reason!r}")


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
