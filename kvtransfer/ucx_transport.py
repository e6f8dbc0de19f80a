"""UCX: the unit's header on the control connection, its bytes as one UCX tagged message
(RDMA across hosts; shared memory / CMA on one host, as UCX decides).

Sender: the unit's bytes (in place, or gathered into a staging buffer that lives until UCX
is done with it), hashed in the pass that gathers them, announced by a UCX_DATA header carrying the message's tag, then
sent. Every send's completion is tracked per transfer: DONE leaves only after all of them
succeeded, and a failed send fails the transfer. Receiver: one receive per unit, posted at
the destination itself when it is contiguous (else into a staging buffer scattered on
arrival), verified when it completes (in the scattering pass). A grant that fails while receives are posted cancels
them, and its blocks are not reported free until UCX has completed each one.

A message that will not land in the cache is still received, into a zero-byte buffer (UCX
discards it, truncated, and the sender's send completes), so nothing is left unmatched: a
refused unit's, and (after a cancelled receive) whichever comes second of the sender's late
message and our own cancelling one. A connection posts at most ``MAX_DRAINS`` such receives
(then it waits for earlier ones to land: a live sender's messages are on their way); drains
that wait ``DRAIN_TIMEOUT_S`` without one landing drop the connection, and a connection that
ends cancels its drains.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from pdserve.kvtransfer.protocol import FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.tcp_transport import flipped
from pdserve.kvtransfer.transport_api import IO_TIMEOUT_S, ReceiveContext, SendContext, Unit
from pdserve.kvtransfer.ucx_worker import TAG_BITS, ucx_available, ucx_unavailable_reason

_SEQUENCE_MASK = (1 << TAG_BITS) - 1
_MAX_KEPT_ERRORS = 1024  # failed sends' errors kept for a flush that may never come
MAX_DRAINS = 64  # receives one connection's drains may have posted
DRAIN_TIMEOUT_S = IO_TIMEOUT_S  # how long drains may wait without one of them landing
_NOTHING = memoryview(bytearray(1))[:0]  # what a drain receives into


def unavailable_reason(device) -> str | None:
    return None if ucx_available() else ucx_unavailable_reason()


class Sender:
    name = "ucx"

    def __init__(self, ctx: SendContext) -> None:
        if ctx.ucx is None:
            raise ValueError("the decode worker chose UCX but UCX is not running here")
        self.ctx = ctx
        self.peer = bytes.fromhex(ctx.remote_extra["ucx_address"])
        self.tag = int(ctx.remote_extra["ucx_tag"])
        try:
            ctx.ucx.connect(self.peer).result(timeout=IO_TIMEOUT_S)
        except concurrent.futures.TimeoutError as e:  # not an OSError before Python 3.11
            raise TimeoutError(f"UCX endpoint to the decode worker not up within {IO_TIMEOUT_S} s") from e
        self.sequence = 0
        self._in_flight: Counter[int] = Counter()  # transfer id -> sends not completed yet
        self._errors: dict[int, BaseException] = {}  # kept for flush; a transfer given up never flushes
        self._done = threading.Condition()

    max_span_bytes = 8 << 20  # each message costs a frame, a rendezvous and a completion: fewer, larger ones

    def send(self, unit: Unit) -> None:
        data, digest = self.ctx.cache.read_hashed(unit.layer, unit.src, unit.ready, unit.num_layers)
        try:
            payload = data.data
            if self.ctx.faults.take("corrupt"):
                payload = flipped(payload)
            sequence, self.sequence = self.sequence, self.sequence + 1
            self.ctx.send_frame(
                FrameHeader(
                    FrameKind.UCX_DATA,
                    unit.transfer_id,
                    unit.layer,
                    unit.start,
                    unit.end,
                    aux=sequence & _SEQUENCE_MASK,
                    checksum=digest,
                    num_layers=unit.num_layers,
                )
            )
        except BaseException:
            data.release()
            raise
        with self._done:
            self._in_flight[unit.transfer_id] += 1

        def sent(error: BaseException | None) -> None:  # on the UCX thread
            data.release()
            with self._done:
                self._in_flight[unit.transfer_id] -= 1
                if self._in_flight[unit.transfer_id] <= 0:  # nothing kept for a transfer with no send pending
                    del self._in_flight[unit.transfer_id]
                if error is not None:
                    self._errors.setdefault(unit.transfer_id, error)
                    while len(self._errors) > _MAX_KEPT_ERRORS:  # the oldest: transfers that never flushed
                        del self._errors[next(iter(self._errors))]
                self._done.notify_all()

        self.ctx.ucx.send(self.peer, payload, (self.tag << TAG_BITS) | (sequence & _SEQUENCE_MASK), sent)

    def flush(self, transfer_id: int) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self._in_flight[transfer_id] <= 0, IO_TIMEOUT_S):
                raise TimeoutError("UCX sends did not complete")
            self._in_flight.pop(transfer_id, None)
            error = self._errors.pop(transfer_id, None)
        if error is not None:
            raise ConnectionError(f"UCX send failed: {error}")

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _ReceiveState:
    """One posted receive's end, as its cancel and its completion see it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    over: bool = False


class Receiver:
    def __init__(self, ctx: ReceiveContext) -> None:
        self.ctx = ctx
        self.tag = secrets.randbits(23) + 1
        self.handlers = {FrameKind.UCX_DATA: self._ucx_data}
        self._draining: dict[int, int] = {}  # drain -> its tag: messages received into nothing, not in yet
        self._drains = itertools.count()  # a drain's key: a peer may repeat tags
        self._drained = threading.Condition()
        self._progress_at = 0.0  # when a drain last landed (or the first of those waiting was posted)
        self._closed = False

    def hello_extra(self) -> dict:
        return {"ucx_address": self.ctx.ucx.address.hex(), "ucx_tag": self.tag} if self.ctx.ucx else {}

    def _ucx_data(self, h: FrameHeader) -> None:
        ucx, ledger, cache = self.ctx.ucx, self.ctx.ledger, self.ctx.cache
        if ucx is None:
            raise ProtocolError("UCX_DATA frame, but UCX is not running here")
        nbytes = (h.end - h.start) * cache.token_bytes * h.num_layers
        if not 0 < nbytes <= self.ctx.max_unit_bytes(h.num_layers):  # before anything is allocated for it
            raise ProtocolError(f"UCX_DATA frame for tokens [{h.start}, {h.end}) of {h.num_layers} layers is too large")
        tag = (self.tag << TAG_BITS) | (h.aux & _SEQUENCE_MASK)
        grant = ledger.admit(h.transfer_id, h.layer, h.start, h.end, nbytes, "UCX_DATA", h.num_layers)
        if grant is None:
            self._drain(tag)
            return
        try:
            target = cache.write_target(h.layer, grant.slots(cache, h.start, h.end), h.num_layers)
        except BaseException:
            ledger.end_write(grant, h.layer, h.start, h.end, None, num_layers=h.num_layers)
            raise
        # A cancel sends our own message for the tag unless the receive is over; then the
        # receive takes one of the two messages and a drain the other.
        state = _ReceiveState()

        def cancel() -> None:
            with state.lock:
                if state.over:
                    return
                state.cancelled = True
            ucx.cancel_recv(tag)

        def landed(error: BaseException | None) -> None:  # on the UCX thread
            with state.lock:
                state.over = True
                cancelled = state.cancelled
            ok = None
            try:
                if error is None and not cancelled:
                    ok = target.commit_hashed() == h.checksum
            finally:
                target.release()
                ledger.end_write(grant, h.layer, h.start, h.end, ok, cancel, h.num_layers)
            if cancelled and error is None:
                self._drain(tag, wait=False)

        ledger.on_cancel(grant, cancel)
        ucx.recv(target.data, tag, landed)

    def _drain(self, tag: int, wait: bool = True) -> None:
        """Receives one message of ``tag`` into nothing (truncated: UCX discards it, and the
        sender's send completes), in a completion queue of its own: it may land before, after or
        instead of the connection's other receives. ``wait``: first wait, on the connection's
        thread, until fewer than MAX_DRAINS are posted."""
        with self._drained:
            if wait and not self._drained.wait_for(lambda: len(self._draining) < MAX_DRAINS, DRAIN_TIMEOUT_S):
                raise ProtocolError(f"{len(self._draining)} announced UCX messages did not come in {DRAIN_TIMEOUT_S} s")
            key = None
            if not self._closed:  # after close nothing cancels it: the peer's message, if it comes, ends it
                if not self._draining:
                    self._progress_at = time.monotonic()
                key = next(self._drains)
                self._draining[key] = tag

        def drained(error: BaseException | None) -> None:  # on the UCX thread; truncated, as it should be
            if key is None:
                return
            with self._drained:
                del self._draining[key]
                self._progress_at = time.monotonic()
                self._drained.notify_all()

        self.ctx.ucx.recv(_NOTHING, tag, drained, out_of_order=True)

    def check(self) -> None:
        """Drops the connection (raises) when its drains have waited DRAIN_TIMEOUT_S without one landing."""
        with self._drained:
            stalled = bool(self._draining) and time.monotonic() - self._progress_at > DRAIN_TIMEOUT_S
        if stalled:
            raise ProtocolError(f"announced UCX messages did not come for {DRAIN_TIMEOUT_S} s")

    def close(self) -> None:
        with self._drained:
            self._closed = True
            posted = list(self._draining.values())
        for tag in posted:  # the peer is gone: its messages may never come
            self.ctx.ucx.cancel_recv(tag)
