"""A small Python client for the Router service (what ``pdserve generate`` uses)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import grpc

from pdserve.grpc_server import channel_options
from pdserve.settings import DEFAULT_ROUTER_PORT
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_ROUTER_PORT}"


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    request_id: str = "",
    priority: int = 0,
    **fields,
) -> pb.GenerateRequest:
    """``fields``: the request's own options (ttft_budget_ms, add_generation_prompt,
    continue_final_message) and its sampling parameters: max_tokens, temperature, top_p, top_k,
    seed, stop (a string or a list), stop_token_ids, ignore_eos, n, best_of... (None = default).
    A value the message cannot carry (out of its integer's range, text that is not UTF-8) or a
    chat message without its role or content is a ValueError naming the field."""
    with _naming("request_id"):
        req = pb.GenerateRequest(request_id=request_id)
    with _naming("priority"):
        req.priority = priority
    if prompt is not None:
        with _naming("prompt"):
            req.prompt = prompt
    with _naming("prompt_token_ids"):
        req.prompt_token_ids.extend(prompt_token_ids or [])
    for i, m in enumerate(messages or []):
        with _naming(f"messages[{i}]"):
            req.messages.add(role=m["role"], content=m["content"])
    for name, value in fields.items():
        if value is None:
            continue
        own = name in _REQUEST_OPTIONS
        with _naming(name if own else f"sampling.{name}"):
            _assign(req if own else req.sampling, name, value)
    return req


# GenerateRequest's fields a keyword sets on the request itself; every other keyword is sampling.
_REQUEST_OPTIONS = frozenset(pb.GenerateRequest.DESCRIPTOR.fields_by_name) - {"sampling"}


def _assign(message, name: str, value) -> None:
    field = getattr(message, name)
    if hasattr(field, "extend"):
        field.extend([value] if isinstance(value, str) else value)  # stop="END" is one stop string
    elif hasattr(field, "CopyFrom"):  # a message (structured_output): copied in, not assigned
        field.CopyFrom(value)
    else:
        setattr(message, name, value)


@contextlib.contextmanager
def _naming(field: str) -> Iterator[None]:
    try:
        yield
    except AttributeError:
        raise ValueError(f"{field}: no such field") from None
    except KeyError as e:  # a chat message given without its role or content
        raise ValueError(f"{field}: missing {e}") from None
    except (ValueError, TypeError) as e:  # protobuf's own words name neither the field nor the message
        raise ValueError(f"{field}: {e}") from None


class Client:
    def __init__(
        self, address: str = DEFAULT_ADDRESS, credentials: grpc.ChannelCredentials | None = None, metadata: tuple = ()
    ) -> None:
        options = channel_options()
        self.channel = (
            grpc.secure_channel(address, credentials, options)
            if credentials
            else grpc.insecure_channel(address, options)
        )
        self.stub = pdserve_pb2_grpc.RouterStub(self.channel)
        self.metadata = metadata

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(
        self, prompt: str | None = None, timeout: float | None = None, **kwargs
    ) -> tuple[list[int], str, pb.GenerateResponse]:
        """Runs a request to completion: (token ids, text, last message). One choice: with
        n > 1 the messages of several choices interleave; read ``stream`` and group by ``index``."""
        request = build_request(prompt, **kwargs)
        if request.sampling.n > 1:
            raise ValueError("n: generate() returns one choice; use stream() and group messages by their index")
        ids, text, last = [], [], None
        for msg in self.stream(request, timeout=timeout):
            ids += msg.token_ids
            text.append(msg.text)
            last = msg
        return ids, "".join(text), last

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
