"""UCX: the unit's header on the control connection, its bytes as one UCX tagged message
(RDMA across hosts; shared memory / CMA on one host, as UCX decides).

Sender: the unit's bytes (in place, or gathered into a staging buffer that lives until UCX
is done with it), hashed in the pass that gathers them, announced by a UCX_DATA header carrying the message's tag, then
sent. Every send's completion is tracked per transfer: DONE leaves only after all of them
succeeded, and a failed send fails the transfer. Receiver: one receive per unit, posted at
the destination itself when it is contiguous (else into a staging buffer scattered on
arrival), verified when it completes (in the scattering pass). A grant that fails while receives are posted cancels
them, and its blocks are not reported free until UCX has completed each one.

A message that will not land in the cache is still received, into scratch, so the sender's
send completes and nothing is left unmatched in UCX: a refused unit's, and (after a cancelled
receive) whichever comes of the sender's late message and our own cancelling one. These drains
are bounded per connection (``MAX_DRAINING_BYTES`` of scratch, ``MAX_DRAINS`` receives): past
that the connection waits for earlier ones to land (a live sender's bytes are on their way). A
drain not landed within ``DRAIN_TIMEOUT_S`` drops the connection, and a connection that ends
cancels its drains, so their buffers come back.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import Counter

from pdserve.kvtransfer.protocol import MAX_SPAN_BYTES, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.tcp_transport import flipped
from pdserve.kvtransfer.transport_api import IO_TIMEOUT_S, ReceiveContext, SendContext, Unit
from pdserve.kvtransfer.ucx_worker import TAG_BITS, ucx_available, ucx_unavailable_reason

_SEQUENCE_MASK = (1 << TAG_BITS) - 1
MAX_DRAINING_BYTES = 4 * MAX_SPAN_BYTES  # scratch one connection's drains may hold (one drain may hold more)
MAX_DRAINS = 64  # receives one connection's drains may have posted
DRAIN_TIMEOUT_S = IO_TIMEOUT_S  # how long a drain may wait for its message


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
        ctx.ucx.connect(self.peer).result(timeout=IO_TIMEOUT_S)
        self.sequence = 0
        self._in_flight: Counter[int] = Counter()  # transfer id -> sends not completed yet
        self._errors: dict[int, BaseException] = {}
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
                if error is not None:
                    self._errors.setdefault(unit.transfer_id, error)
                self._done.notify_all()

        self.ctx.ucx.send(self.peer, payload, (self.tag << TAG_BITS) | (sequence & _SEQUENCE_MASK), sent)

    def flush(self, transfer_id: int) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self._in_flight[transfer_id] <= 0, IO_TIMEOUT_S):
                raise TimeoutError("UCX sends did not complete")
            del self._in_flight[transfer_id]
            error = self._errors.pop(transfer_id, None)
        if error is not None:
            raise ConnectionError(f"UCX send failed: {error}")

    def close(self) -> None:
        pass


class Receiver:
    def __init__(self, ctx: ReceiveContext) -> None:
        self.ctx = ctx
        self.tag = secrets.randbits(23) + 1
        self.handlers = {FrameKind.UCX_DATA: self._ucx_data}
        self._draining: dict[int, tuple[int, int, float]] = {}  # drain -> (tag, scratch bytes, posted at)
        self._draining_bytes = 0
        self._drains = itertools.count()  # a drain's key: a peer may repeat tags
        self._drained = threading.Condition()
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
            self._drain(tag, nbytes)
            return
        try:
            target = cache.write_target(h.layer, grant.slots(cache, h.start, h.end), h.num_layers)
        except BaseException:
            ledger.end_write(grant, h.layer, h.start, h.end, None, num_layers=h.num_layers)
            raise
        cancelled = threading.Event()

        def cancel() -> None:
            cancelled.set()
            ucx.cancel_recv(tag)

        def landed(error: BaseException | None) -> None:  # on the UCX thread
            ok = None
            try:
                if error is None and not cancelled.is_set():
                    ok = target.commit_hashed() == h.checksum
            finally:
                target.release()
                ledger.end_write(grant, h.layer, h.start, h.end, ok, cancel, h.num_layers)
            if cancelled.is_set() and error is None:  # one of two messages took the receive: drain the other
                self._drain(tag, nbytes, wait=False, out_of_order=True)

        ledger.on_cancel(grant, cancel)
        ucx.recv(target.data, tag, landed)

    def _drain(self, tag: int, nbytes: int, wait: bool = True, out_of_order: bool = False) -> None:
        """Receives one message of ``tag`` into scratch. ``wait``: first wait (on the connection's
        thread) for room within the connection's bounds; a drain alone may exceed them.
        ``out_of_order``: posted after receives of later units (it must not hold up theirs)."""
        staging = self.ctx.cache.host_staging
        size = staging.size_for(nbytes)

        def room() -> bool:
            return not self._draining or (
                self._draining_bytes + size <= MAX_DRAINING_BYTES and len(self._draining) < MAX_DRAINS
            )

        with self._drained:
            if wait and not self._drained.wait_for(room, DRAIN_TIMEOUT_S):
                raise ProtocolError(f"{len(self._draining)} announced UCX messages did not come in {DRAIN_TIMEOUT_S} s")
            if self._closed:
                return  # the connection's drains are cancelled
            key = next(self._drains)
            self._draining[key] = (tag, size, time.monotonic())
            self._draining_bytes += size
        scratch = staging.take(nbytes)

        def drained(error: BaseException | None) -> None:  # on the UCX thread
            staging.give(scratch)
            with self._drained:
                self._draining_bytes -= self._draining.pop(key)[1]
                self._drained.notify_all()

        self.ctx.ucx.recv(scratch[:nbytes].numpy(), tag, drained, out_of_order)

    def check(self) -> None:
        """Drops the connection (raises) once a drain has waited too long for its message."""
        with self._drained:
            oldest = min((posted for _, _, posted in self._draining.values()), default=None)
        if oldest is not None and time.monotonic() - oldest > DRAIN_TIMEOUT_S:
            raise ProtocolError(f"an announced UCX message did not come in {DRAIN_TIMEOUT_S} s")

    def close(self) -> None:
        with self._drained:
            self._closed = True
            posted = [tag for tag, _, _ in self._draining.values()]
        for tag in posted:  # the peer is gone: its messages may never come
            self.ctx.ucx.cancel_recv(tag)
