"""UCX: the unit's header on the control connection, its bytes as one UCX tagged message
(RDMA across hosts; shared memory / CMA on one host, as UCX decides).

Sender: the unit's bytes (in place, or gathered into a staging buffer that lives until UCX
is done with it), hashed in the pass that gathers them, announced by a UCX_DATA header carrying the message's tag, then
sent. Every send's completion is tracked per transfer: DONE leaves only after all of them
succeeded, and a failed send fails the transfer. Receiver: one receive per unit, posted at
the destination itself when it is contiguous (else into a staging buffer scattered on
arrival), verified when it completes (in the scattering pass). A grant that fails while receives are posted cancels
them, and its blocks are not reported free until UCX has completed each one.

A refused unit's message is still received (into a scratch buffer), so the sender's send
completes. Those drains are bounded per connection: past ``MAX_DRAINING_BYTES`` the connection
waits for earlier ones to land (a live sender's bytes are on their way), and a peer whose
announced messages do not come within ``DRAIN_TIMEOUT_S`` is dropped; the drains still posted
when a connection ends are cancelled, so their buffers come back.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import Counter

from pdserve.kvtransfer.protocol import MAX_SPAN_BYTES, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.tcp_transport import flipped
from pdserve.kvtransfer.transport_api import IO_TIMEOUT_S, ReceiveContext, SendContext, Unit
from pdserve.kvtransfer.ucx_worker import TAG_BITS, ucx_available, ucx_unavailable_reason

_SEQUENCE_MASK = (1 << TAG_BITS) - 1
MAX_DRAINING_BYTES = 4 * MAX_SPAN_BYTES  # refused units' bytes one connection may have posted and not landed
DRAIN_TIMEOUT_S = IO_TIMEOUT_S  # how long announced messages may keep the next drain waiting


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
        self._draining: dict[int, tuple[int, int]] = {}  # drain -> (tag, bytes): refused units' messages not landed yet
        self._drains = itertools.count()  # a drain's key: a peer may repeat tags
        self._drained = threading.Condition()

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

        ledger.on_cancel(grant, cancel)
        ucx.recv(target.data, tag, landed)

    def _drain(self, tag: int, nbytes: int) -> None:
        """Receives a refused unit's message into scratch, so the sender's send completes."""

        def held() -> int:
            return sum(n for _, n in self._draining.values())

        with self._drained:
            if not self._drained.wait_for(lambda: held() + nbytes <= MAX_DRAINING_BYTES, DRAIN_TIMEOUT_S):
                raise ProtocolError(
                    f"{held()} bytes of refused units were announced and not sent in {DRAIN_TIMEOUT_S} s"
                )
            key = next(self._drains)
            self._draining[key] = (tag, nbytes)
        staging = self.ctx.cache.host_staging
        scratch = staging.take(nbytes)

        def drained(error: BaseException | None) -> None:  # on the UCX thread
            staging.give(scratch)
            with self._drained:
                del self._draining[key]
                self._drained.notify_all()

        self.ctx.ucx.recv(scratch[:nbytes].numpy(), tag, drained)

    def close(self) -> None:
        with self._drained:
            posted = [tag for tag, _ in self._draining.values()]
        for tag in posted:  # the peer is gone: its messages may never come
            self.ctx.ucx.cancel_recv(tag)
