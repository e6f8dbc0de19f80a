"""Serving the router's HTTP app with uvicorn in the router's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.addresses import join_host_port
from pdserve.security import SecuritySettings

REQUEST_HEAD_TIMEOUT_S = 10.0  # from connecting (or the last response) to a whole request head
REQUEST_BODY_TIMEOUT_S = 60.0  # from the head to the whole body (16 MiB at most: ~2 Mbit/s)


class _TimedH11(H11Protocol):
    """uvicorn times out an idle connection only after a response: one that never sends (or
    dribbles) its request head, or its body, held a descriptor, a handler and its state
    forever, and a few hundred of them starved the router (slowloris). Such a connection is
    closed after ``REQUEST_HEAD_TIMEOUT_S`` for the head and ``REQUEST_BODY_TIMEOUT_S`` more for
    the body, like nginx's client_header_timeout and client_body_timeout."""

    _timer: asyncio.TimerHandle | None = None
    _awaiting: object = None  # what the timer waits to see end: h11.IDLE (a head) or h11.SEND_BODY (a body)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time(h11.IDLE)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE or state is h11.SEND_BODY:
            if self._awaiting is not state and not self.transport.is_closing():
                # The head is in and its body is coming; or a body that came after its response
                # (a 404 before it was read) ended and a new cycle began.
                self._time(state)
        else:  # the whole request is in: the request's own timeouts rule
            self._stop_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Kept alive: the next head is awaited, or a pipelined request's body (uvicorn has read its
        # head from the buffer). A body still coming for this response keeps its running timer.
        state = self.conn.their_state
        if (state is h11.IDLE or state is h11.SEND_BODY) and self._awaiting is not state:
            self._time(state)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _time(self, state) -> None:
        self._stop_timer()
        timeout = REQUEST_HEAD_TIMEOUT_S if state is h11.IDLE else REQUEST_BODY_TIMEOUT_S
        self._awaiting = state
        self._timer = self.loop.call_later(timeout, self._timed_out)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._awaiting = None

    def _timed_out(self) -> None:
        still = self.conn.their_state is self._awaiting
        self._timer = self._awaiting = None
        if still and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def _tls_options(security: SecuritySettings | None) -> dict[str, Any]:
    """The router's gRPC TLS settings, applied to HTTP: HTTPS with --tls-cert/--tls-key, client
    certificates signed by --tls-ca required with --tls-client-auth."""
    if security is None or not security.tls:
        return {}
    options: dict[str, Any] = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
    if security.tls_client_auth:
        options.update(ssl_ca_certs=security.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def serve_http(
    app, host: str, port: int, *, graceful_shutdown_s: float = 5.0, security: SecuritySettings | None = None
) -> tuple[uvicorn.Server, asyncio.Task]:
    """Serves ``app`` with uvicorn in the running event loop (HTTPS when ``security`` has TLS);
    returns once it accepts connections. Binding errors (port in use) raise OSError here. Stop
    it with ``server.should_exit = True`` and ``await task``; ``http_port(server)`` is the bound
    port (useful with port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise OSError(f"--http-port: could not bind {join_host_port(host, port)}: {e.strerror or e}") from None
    config = uvicorn.Config(
        app,
        http=_TimedH11,
        log_level="warning",
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=graceful_shutdown_s,
        **_tls_options(security),
    )
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
