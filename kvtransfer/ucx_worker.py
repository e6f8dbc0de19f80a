"""UCX (via ``ucxx``, the maintained successor of ucx-py) on one dedicated thread.

One thread owns a UCX worker and is the only one that touches it: other threads queue
commands, and completions come back as callbacks on this thread. It sleeps in epoll on the
worker's event fd and a wake-up pipe; when woken it runs queued commands, progresses the
worker and collects completions.

Endpoints are created from the peer's *worker address* (exchanged in our own handshake)
with UCX error handling off: that is what lets UCX pick shared memory / CMA on one host
(listener endpoints force error handling, which rules those out and falls back to TCP).

Completion without scanning every pending request: requests wait in one FIFO per connection
tag (its sends on one side, its receives on the other), and UCX matches the messages of one
peer in the order they were sent, so only each queue's head is checked (a receive that may complete out of that
order waits in a queue of its own). Cancelling a posted receive: ucxx offers no
per-request cancel, so the worker sends itself an empty message with the receive's tag; the
receive completes (with nothing in it) and from then on nothing can land in its buffer.

Stopping: ucxx's worker destructor receives every message no receive took, cancels what is
in flight, and waits for each to end; a rendezvous message whose sender stopped, or a send no
peer takes, never does. So the stop receives those messages itself and gives sends a bounded
time; a worker left with one that cannot end is kept until the process exits, not destroyed.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import itertools
import logging
import os
import select
import threading
import time
import weakref
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

# Before importing ucxx: keep UCX quiet about variables it does not know.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
_IMPORT_ERROR: str | None = None
try:
    from ucxx._lib import libucxx as _ucx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMask
except Exception as e:  # noqa: BLE001 - any failure means: no UCX here
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

TAG_BITS = 40  # a tag is (connection tag << TAG_BITS) | sequence number
MAX_APART = 1024  # cancelled tags remembered for a receive not posted yet
SETTLE_S = 2.0  # at stop: how long stray messages and unfinished sends get to end
Done = Callable[[BaseException | None], None]
_LIVE: "weakref.WeakSet[UcxWorker]" = weakref.WeakSet()  # closed at exit: UCX must not die under its thread


def ucx_available() -> bool:
    return _IMPORT_ERROR is None


def ucx_unavailable_reason() -> str:
    return f"ucxx is not importable ({_IMPORT_ERROR}); install it with: pip install 'pdserve[ucx]'"


class UcxWorker:
    def __init__(self, loopback_only: bool = False) -> None:
        """``loopback_only``: a worker bound to loopback keeps UCX there too. UCX's TCP
        transport otherwise listens on every network device (unless UCX_NET_DEVICES says)."""
        if not ucx_available():
            raise RuntimeError(ucx_unavailable_reason())
        config = {"NET_DEVICES": "lo"} if loopback_only and "UCX_NET_DEVICES" not in os.environ else {}
        self._context = _ucx.UCXContext(config)
        self._worker = _ucx.UCXWorker(self._context, enable_delayed_submission=False, enable_python_future=False)
        self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        # Requests still posted at stop, kept with their buffers. Set after the worker, so freed
        # after it (its destructor cancels what is still posted into them).
        self._posted: list = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._commands: deque[tuple[Callable[[], None], Callable[[BaseException], None]]] = deque()
        self._lock = threading.Lock()  # orders submissions against the stop
        self._queues: dict[object, deque] = {}  # FIFO of (request, keepalive, done, tag) per connection
        self._alone = itertools.count()  # keys of out-of-order receives' queues
        self._apart: dict[int, None] = {}  # tags cancelled before their receive was posted (oldest first)
        self._endpoints: dict[bytes, object] = {}
        self._self_endpoint = None
        self._stopped = False
        self.kept_until_exit = False  # set at stop when destroying the worker would wait for ever
        self._thread = threading.Thread(target=self._run, name="ucx-progress", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- any thread ---------------------------------------------------------------------------
    def connect(self, peer_address: bytes) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def connect() -> None:
            self._endpoint(peer_address)
            future.set_result(None)

        self._submit(connect, lambda e: future.set_exception(e))
        return future

    def send(self, peer_address: bytes, buffer, tag: int, done: Done) -> None:
        """Sends ``buffer`` (kept alive until ``done``) as one tagged message. Completions come in
        the order of the connection's sends (one connection tag: a send that never completes
        holds up only its own connection's)."""

        def send() -> None:
            array = Array(buffer)
            key = ("send", peer_address, tag >> TAG_BITS)
            self._track(key, self._endpoint(peer_address).tag_send(array, Tag(tag)), (array, buffer), done)

        self._submit(send, done)

    def recv(self, buffer, tag: int, done: Done, out_of_order: bool = False) -> None:
        """Posts a receive of one tagged message into ``buffer``, in place. Completions come in
        the order the connection's receives were posted; ``out_of_order``: a receive that may
        complete later than receives posted after it (or never), so it waits in a queue of its own."""

        def recv() -> None:
            array = Array(buffer)
            apart = out_of_order or tag in self._apart
            self._apart.pop(tag, None)
            key = ("alone", next(self._alone)) if apart else ("recv", tag >> TAG_BITS)
            self._track(key, self._worker.tag_recv(array, Tag(tag)), (array, buffer), done, tag)

        self._submit(recv, done)

    def cancel_recv(self, tag: int) -> None:
        """Completes a posted receive with an empty message of its own: nothing lands after. It
        then completes out of its connection's order, so it waits in a queue of its own."""

        def cancel() -> None:
            self._set_apart(tag)
            empty = bytearray(1)
            array = Array(memoryview(empty)[:0])
            self._track(
                ("cancel", tag), self._endpoint(self.address).tag_send(array, Tag(tag)), (array, empty), lambda e: None
            )

        self._submit(cancel, lambda e: log.warning("could not cancel a UCX receive: %s", e))

    def close(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._wake()
        self._thread.join(5)
        if self._thread.is_alive():
            log.warning("the UCX progress thread did not stop in 5 s")

    # -- the UCX thread ---------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        with self._lock:
            if not self._stopped:
                self._commands.append((command, on_error))
                self._wake()
                return
        on_error(RuntimeError("UCX worker stopped"))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is already pending

    def _endpoint(self, peer_address: bytes):
        endpoint = self._endpoints.get(peer_address)
        if endpoint is None:
            address = _ucx.UCXAddress.create_from_buffer(peer_address)
            endpoint = self._endpoints[peer_address] = self._worker.create_endpoint_from_worker_address(address, False)
        return endpoint

    def _track(self, queue_key, request, keepalive, done: Done, tag: int | None = None) -> None:
        self._queues.setdefault(queue_key, deque()).append((request, keepalive, done, tag))

    def _set_apart(self, tag: int) -> None:
        """Moves the receive of ``tag`` out of its connection's queue (or, not posted yet, marks it)."""
        queue = self._queues.get(("recv", tag >> TAG_BITS), ())
        for entry in queue:
            if entry[3] == tag:
                queue.remove(entry)
                self._queues[("alone", next(self._alone))] = deque([entry])
                return
        self._apart[tag] = None
        if len(self._apart) > MAX_APART:  # tags whose receive had ended already: forget the oldest
            del self._apart[next(iter(self._apart))]

    def _run(self) -> None:
        while not self._stopped:
            while self._commands:
                command, on_error = self._commands.popleft()
                try:
                    command()
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    on_error(e)
            while self._worker.progress_once():
                pass
            self._complete()
            if self._commands or not self._worker.arm():
                continue  # more work, or events came in while we progressed
            self._epoll.poll(1.0)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        with self._lock:  # no command comes in after this
            left, self._commands = list(self._commands), deque()
        stopped = RuntimeError("UCX worker stopped")
        entries = [entry for queue in self._queues.values() for entry in queue]
        sends = [entry for key, queue in self._queues.items() if key[0] in ("send", "cancel") for entry in queue]
        self._queues.clear()
        for done in [on_error for _, on_error in left] + [done for _, _, done, _ in entries]:
            self._call(done, stopped)
        self._posted = entries
        try:
            settled = self._settle(sends)
        except Exception:  # noqa: BLE001 - a worker UCX failed: destroying it is no safer
            log.exception("UCX failed while its worker stopped")
            settled = False
        for endpoint in self._endpoints.values():
            endpoint.close_blocking(period=10**8)
        self._endpoints.clear()
        if not settled:
            log.warning(
                "a UCX message could not end at stop (its peer stopped): the worker is kept until the process exits"
            )
            self.kept_until_exit = True
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))  # never destroyed, not even at exit

    def _settle(self, sends: list) -> bool:
        """Receives the messages no receive took (a rendezvous one needs its sender to progress)
        and gives unfinished sends time to end: True when nothing is left unfinished."""
        strays = []
        deadline = time.monotonic() + SETTLE_S
        while True:
            while self._worker.progress_once():
                pass
            late = time.monotonic() > deadline
            probe = self._worker.tag_probe(Tag(0), TagMask(0), remove=not late)
            unfinished = [entry for entry in strays + sends if not entry[0].completed]
            if late and (probe.matched or unfinished):  # a peer that keeps sending, or what cannot end
                self._posted += unfinished
                return False
            if probe.matched:
                buffer = bytearray(probe.length + 1)
                strays.append((self._worker.tag_recv_with_handle(Array(memoryview(buffer)[:-1]), probe), buffer))
            elif not unfinished:
                return True
            else:
                time.sleep(0.001)

    def _complete(self) -> None:
        for key, queue in list(self._queues.items()):
            while queue and queue[0][0].completed:
                request, _, done, _ = queue.popleft()
                try:
                    request.check_error()
                except Exception as e:  # noqa: BLE001 - reported to whoever waits
                    error = e
                else:
                    error = None
                self._call(done, error)
            if not queue:
                del self._queues[key]  # peers and connections come and go

    @staticmethod
    def _call(done: Done, error: BaseException | None) -> None:
        try:
            done(error)
        except Exception:  # a callback's bug must not stop the thread every transfer relies on
            log.exception("a UCX completion callback failed")


@atexit.register
def _close_live_workers() -> None:
    for worker in list(_LIVE):
        worker.close()
