"""The router's HTTP server on loopback: connections that never send a whole request head, or
its whole body, are closed (slowloris); requests that take longer than that are not cut."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI, Request

from pdserve.router import http_server
from pdserve.router.http_server import http_port, serve_http

HEAD_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0


@pytest.fixture
async def server(monkeypatch):
    monkeypatch.setattr(http_server, "REQUEST_HEAD_TIMEOUT_S", HEAD_TIMEOUT_S)
    monkeypatch.setattr(http_server, "REQUEST_BODY_TIMEOUT_S", BODY_TIMEOUT_S)
    app = FastAPI()

    @app.post("/size")
    async def size(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(3 * HEAD_TIMEOUT_S)  # longer than a head may take: the answer still comes
        return {"ok": True}

    srv, task = await serve_http(app, "127.0.0.1", 0)
    yield http_port(srv)
    srv.should_exit = True
    await task


async def closed_after(reader: asyncio.StreamReader, limit_s: float = 10.0) -> float:
    """Seconds until the server closes the connection (reading whatever it sent)."""
    start = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), limit_s):
        pass
    return time.monotonic() - start


async def closed_while_sending(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, byte: bytes, rounds: int
) -> float | None:
    """Sends ``byte`` (if any) every 0.2 s, ``rounds`` times at most, reading whatever the
    server answers; the seconds until it closed the connection, or None if it never did."""
    start = time.monotonic()
    for _ in range(rounds):
        try:
            if byte:
                writer.write(byte)
                await writer.drain()
            if not await asyncio.wait_for(reader.read(65536), 0.2):
                return time.monotonic() - start
        except asyncio.TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start
    return None


async def test_a_connection_that_sends_nothing_is_closed(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    assert await closed_after(reader) < HEAD_TIMEOUT_S + 2
    writer.close()


async def test_a_request_head_dribbled_byte_by_byte_is_closed(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
    closed = await closed_while_sending(reader, writer, b"X", rounds=50)  # 10 s of a header trickling in
    assert closed is not None and closed < HEAD_TIMEOUT_S + 2  # closed while it still trickled
    writer.close()


async def test_a_slow_answer_is_not_cut_and_a_kept_alive_connection_is_timed_again(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    for _ in range(2):  # two requests on one connection, each slower than a head may take
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.readexactly(11), 10) == b'{"ok":true}'
    assert await closed_after(reader) < HEAD_TIMEOUT_S + 2  # then idle: the next head is awaited as long
    writer.close()


async def test_a_body_sent_after_its_response_leaves_the_connection_timed(server):
    """Answered before its body was read (a 404), the request's body comes afterwards: the
    next request's head is awaited as long as any, not for ever."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 404")
    await asyncio.sleep(0.1)
    writer.write(b"hello")
    assert await closed_after(reader) < HEAD_TIMEOUT_S + 2
    writer.close()


@pytest.mark.parametrize("dribble, pipelined", [(False, False), (True, False), (False, True)])
async def test_a_request_body_that_stalls_or_dribbles_is_closed(server, dribble, pipelined):
    """The head is whole, the body never is: the connection is closed once the body is overdue,
    whether the client goes silent or keeps sending a byte now and then, and whether the request
    came alone or pipelined behind another."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    first = b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" if pipelined else b""
    writer.write(first + b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    closed = await closed_while_sending(reader, writer, b"x" if dribble else b"", rounds=40)  # 8 s at most
    assert closed is not None and closed < BODY_TIMEOUT_S + 2
    writer.close()


async def test_a_body_that_comes_in_time_is_answered_and_the_next_head_is_timed(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nab")
    await asyncio.sleep(HEAD_TIMEOUT_S + 0.2)  # slower than a head may take, well within the body's time
    writer.write(b"cdef")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    body = b'{"bytes":6}'
    assert f"content-length: {len(body)}".encode() in head.lower()
    assert await asyncio.wait_for(reader.readexactly(len(body)), 10) == body
    assert await closed_after(reader) < HEAD_TIMEOUT_S + 2
    writer.close()
