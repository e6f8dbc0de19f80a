"""A small Python client for the Router service (what ``pdserve generate`` uses)."""

from __future__ import annotations

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
    stop_token_ids, ignore_eos (None = default)."""
    req = pb.GenerateRequest(request_id=request_id, priority=priority)
    if prompt is not None:
        req.prompt = prompt
    req.prompt_token_ids.extend(prompt_token_ids or [])
    for m in messages or []:
        req.messages.add(role=m["role"], content=m["content"])
    for name, value in sampling.items():
        if value is None:
            continue
        field = getattr(req.sampling, name)
        if hasattr(field, "extend"):
            field.extend([value] if isinstance(value, str) else value)  # stop="END" is one stop string
        else:
            setattr(req.sampling, name, value)
    return req


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
        """Runs a request to completion: (token ids, text, last message)."""
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
