"""UCX (via ``ucxx``, the maintained successor of ucx-py) on one dedicated thread.

One thread owns a UCX worker and is the only one that touches it: other threads queue
commands and get ``concurrent.futures.Future`` back. The thread sleeps in epoll on the
worker's event fd; a pipe registered in the same epoll set wakes it when work is queued.

Endpoints are created from the peer's *worker address* (exchanged in our own handshake)
with UCX error handling off: that is what lets UCX pick shared memory / CMA on one host
(listener endpoints force error handling, which rules those out and falls back to TCP).
Receives are posted at their exact destination (a slice of the KV pool), so data lands in
place. A receive whose message never comes would wait forever: callers put a timeout on
every future and cancel it, which drops (and so cancels) the UCX request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import threading
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

# Before importing ucxx: keep UCX quiet about variables it does not know, and stay on
# loopback unless told otherwise (tests and single-host runs).
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
_IMPORT_ERROR: str | None = None
try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag
except Exception as e:  # noqa: BLE001 - any failure means: no UCX here
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def ucx_available() -> bool:
    return _IMPORT_ERROR is None


def ucx_unavailable_reason() -> str:
    return f"ucxx is not importable ({_IMPORT_ERROR}); install it with: pip install 'pdserve[ucx]'"


class _Group:
    """One future for several UCX requests (a unit's runs)."""

    def __init__(self, count: int, future: concurrent.futures.Future) -> None:
        self.left = count
        self.future = future
        self.error: BaseException | None = None

    def one_done(self, error: BaseException | None) -> None:
        self.error = self.error or error
        self.left -= 1
        if self.left == 0 and not self.future.done():
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(None)


class UcxWorkerThread:
    def __init__(self, epoll_timeout_ms: int = 100) -> None:
        if not ucx_available():
            raise RuntimeError(ucx_unavailable_reason())
        self._context = _ucx.UCXContext({})
        self._worker = _ucx.UCXWorker(self._context, enable_delayed_submission=False, enable_python_future=False)
        self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll = select.epoll.fromfd(os.dup(self._worker.epoll_file_descriptor))
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._commands: deque[Callable[[], None]] = deque()
        self._pending: dict[int, tuple[object, object, _Group]] = {}
        self._endpoints: dict[bytes, object] = {}
        self._timeout_ms = epoll_timeout_ms
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ucx-progress", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------
    def connect(self, peer_address: bytes) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def connect() -> None:
            if peer_address not in self._endpoints:
                address = _ucx.UCXAddress.create_from_buffer(peer_address)
                self._endpoints[peer_address] = self._worker.create_endpoint_from_worker_address(address, False)
            future.set_result(None)

        self._submit(connect, future)
        return future

    def send(self, peer_address: bytes, messages: list[tuple[object, int]]) -> concurrent.futures.Future:
        """Sends every (buffer, tag); one future for all. Keep the buffers alive until it resolves."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            endpoint = self._endpoints[peer_address]
            group = _Group(len(messages), future)
            for buffer, tag in messages:
                array = Array(buffer)
                self._track(endpoint.tag_send(array, Tag(tag)), (array, buffer), group)

        self._submit(send, future)
        return future

    def recv(self, messages: list[tuple[object, int]]) -> concurrent.futures.Future:
        """Posts a receive per (buffer, tag) at the buffer's place; one future for all."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def recv() -> None:
            group = _Group(len(messages), future)
            for buffer, tag in messages:
                array = Array(buffer)
                self._track(self._worker.tag_recv(array, Tag(tag)), (array, buffer), group)

        self._submit(recv, future)
        return future

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Drops the requests behind ``future``; their buffers are not touched afterwards."""
        future.cancel()
        self._wake()

    def close(self) -> None:
        self._stopped = True
        self._wake()
        self._thread.join(5)

    # -- the UCX thread ---------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None], future: concurrent.futures.Future) -> None:
        def guarded() -> None:
            try:
                command()
            except Exception as e:  # noqa: BLE001 - reported to the caller
                if not future.done():
                    future.set_exception(e)

        self._commands.append(guarded)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is already pending

    def _track(self, request, keepalive, group: _Group) -> None:
        self._pending[id(request)] = (request, keepalive, group)

    def _run(self) -> None:
        while not self._stopped:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            while self._commands:
                self._commands.popleft()()
            self._reap()  # eager messages and unexpected-queue hits complete inline
            if not self._commands:
                self._worker.progress_worker_event(self._timeout_ms)
            self._reap()
        for request, _, group in list(self._pending.values()):
            group.one_done(RuntimeError("UCX worker stopped"))
        self._pending.clear()
        for endpoint in self._endpoints.values():
            endpoint.close_blocking(period=10**8)
        self._endpoints.clear()

    def _reap(self) -> None:
        for key, (request, _, group) in list(self._pending.items()):
            if group.future.cancelled():
                del self._pending[key]  # dropping the request cancels it
            elif request.completed:
                del self._pending[key]
                try:
                    request.check_error()
                    group.one_done(None)
                except Exception as e:  # noqa: BLE001
                    group.one_done(e)
