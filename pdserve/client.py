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
    **sampling,
) -> pb.GenerateRequest:
    """``sampling``: max_tokens, temperature, top_p, top_k, seed, stop (a string or a list),
    stop_token_ids, ignore_eos, n, best_of... (None = default). A value the message cannot
    carry (out of its integer's range, text that is not UTF-8) is a ValueError naming the field."""
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
    for name, value in sampling.items():
        if value is None:
            continue
        with _naming(f"sampling.{name}"):
            field = getattr(req.sampling, name)
            if hasattr(field, "extend"):
                field.extend([value] if isinstance(value, str) else value)  # stop="END" is one stop string
            elif hasattr(field, "CopyFrom"):  # a message (structured_output): copied in, not assigned
                field.CopyFrom(value)
            else:
                setattr(req.sampling, name, value)
    return req


@contextlib.contextmanager
def _naming(field: str) -> Iterator[None]:
    try:
        yield
    except AttributeError:
        raise ValueError(f"{field}: no such field") from None
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
        if (kwargs.get("n") or 1) > 1:
            raise ValueError("n: generate() returns one choice; use stream() and group messages by their index")
        ids, text, last = [], [], None
        for msg in self.stream(build_request(prompt, **kwargs), timeout=timeout):
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
