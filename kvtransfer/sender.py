"""The prefill side of the KV handoff: one connection per decode worker, the transfers on it.

A connection handshakes over TCP (which stays the control channel) and builds the sending
half of the transport the decode worker chose. The engine thread queues units (a transfer's
``send_layer``, once per layer as the forward pass writes it); the connection's sender thread
moves them in order, so sending layer i overlaps computing layer i+1, and a reader thread
collects acknowledgements. Layers that queue up together (sent after the prefill, or while the
sender catches up) leave as one unit of several layers. While a transfer waits (its request
queued behind other prompts, or computing), the sender thread renews its lease on the decode side.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from pdserve.addresses import split_host_port
from pdserve.engine.kv_connector import Report, TransferOutcome
from pdserve.kvtransfer import registry
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, client_handshake
from pdserve.kvtransfer.layout import KVCacheView, Slots, slots_of
from pdserve.kvtransfer.protocol import (
    HEADER_SIZE,
    MAX_SPAN_BYTES,
    AckStatus,
    FrameHeader,
    FrameKind,
    Holding,
    ProtocolError,
    done_frame,
    placement_digest,
)
from pdserve.kvtransfer.resharding import ReshardedView
from pdserve.kvtransfer.sockets import IdleTimeout, configure, recv_header, recv_payload, shutdown
from pdserve.kvtransfer.transport_api import IO_TIMEOUT_S, SendContext, Unit

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
_NOTHING = object()


@dataclass(frozen=True, slots=True)
class _Done:
    first_token_id: int
    more_token_ids: tuple[int, ...] = ()  # n > 1: the other choices' first tokens


class OutgoingTransfer:
    """One request's transfer on a connection (the engine's ``OutgoingKV``)."""

    def __init__(
        self,
        conn: "KVConnection",
        transfer_id: int,
        dst_block_ids: list[int],
        dst_block_size: int,
        num_tokens: int,
        skip_tokens: int = 0,
    ) -> None:
        self.conn = conn
        self.transfer_id = transfer_id
        self.dst_block_ids = list(dst_block_ids)
        self.dst_block_size = dst_block_size
        self.num_tokens = num_tokens
        self.skip_tokens = skip_tokens  # leading tokens the decode side already holds
        self.cancelled = False
        self.finishing = False  # DONE is queued: no more renewals
        self.failed: str | None = None  # a unit could not be read: report instead of DONE
        self.answered = False  # the decode worker acknowledged it already: send nothing more
        self.held: bool | None = None  # one-sided: the decode worker's answer to our last RENEW
        self._held = threading.Event()
        self.nbytes = 0
        self._report: Report | None = None
        self._reported = False
        self._lock = threading.Lock()  # the ack thread, the sender thread and a broken connection may all resolve
        self._slots_for: tuple[list[int], int, int, Slots, Slots | None] | None = None

    # -- the engine thread ----------------------------------------------------------------------
    def send_layer(self, layer: int, block_ids: list[int], start: int, end: int) -> None:
        """Queues tokens [start, end) of a layer, minus what the decode side already holds."""
        start, end = max(start, self.skip_tokens), min(end, self.num_tokens)
        if start >= end or self.cancelled:
            return
        cached = self._slots_for  # the same table and range for every layer of a step
        if cached is None or cached[0] is not block_ids or cached[1:3] != (start, end):
            try:
                src = self.conn.cache.slots(block_ids, start, end)
                dst = (
                    slots_of(self.dst_block_ids, self.dst_block_size, start, end, self.conn.peer_device)
                    if self.conn.one_sided
                    else None
                )
            except ValueError as e:
                self.failed = str(e)
                return
            self._slots_for = cached = (block_ids, start, end, src, dst)
        ready = None
        if self.conn.cache.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the compute stream, right after this layer's K/V write
        shards = self.conn.remote.tp_size  # one unit per decode rank: exactly its KV heads
        for shard in range(layer * shards, (layer + 1) * shards):
            self.conn.queue(self, Unit(self.transfer_id, shard, start, end, cached[3], cached[4], ready))

    def finish(self, first_token_id: int, report: Report, more_token_ids: tuple[int, ...] = ()) -> None:
        self._report = report
        self.finishing = True
        if self.conn.broken is not None:  # its threads are gone: nobody would answer
            self.resolve(TransferOutcome(False, f"KV connection to {self.conn.address} lost: {self.conn.broken}"))
            return
        self.conn.queue(self, _Done(first_token_id, tuple(more_token_ids)))

    def cancel(self) -> None:
        self.cancelled = True
        self.conn.forget(self)

    close = cancel  # the request is over whatever happened: stop renewing and sending

    # -- connection threads ---------------------------------------------------------------------
    def set_held(self, answer: Holding) -> None:
        held = answer is Holding.HELD
        if not held and self.failed is None:
            self.failed = (
                "the decode worker holds other blocks for this transfer than its target names: nothing written"
                if answer is Holding.MISPLACED
                else "the decode worker no longer holds its blocks (the lease ended): nothing more written"
            )
        self.held = held
        self._held.set()

    def writable(self, timeout_s: float) -> bool:
        """One-sided: whether the decode worker said (within ``timeout_s``) it holds the blocks."""
        if not self._held.wait(timeout_s) and self.failed is None:
            self.failed = f"the decode worker did not confirm its blocks within {timeout_s:.0f} s: nothing written"
        return self.held is True and self.failed is None

    def resolve(self, outcome: TransferOutcome) -> None:
        """Reports the outcome once (never after a cancel)."""
        with self._lock:
            if self._reported or self.cancelled or self._report is None:
                return
            self._reported = True
        self._report(outcome)


class KVConnection:
    def __init__(
        self,
        address: str,
        local: PeerInfo,
        cache: KVCacheView,
        *,
        secret: bytes | None = None,
        ucx=None,
        faults: FaultPlan | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.address = address
        self.cache = cache
        host, port = split_host_port(address)
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        try:
            configure(self.sock, HANDSHAKE_TIMEOUT_S)
            self.remote = client_handshake(self.sock, local, secret, address)
            name = self.remote.extra.get("transport")
            if name not in local.transports:
                raise HandshakeError(f"decode worker {address} chose {name!r}, which this worker does not offer")
            spec = registry.get(name)
            if self.remote.tp_size != local.tp_size:  # the decode ranks hold other heads than ours
                cache = ReshardedView(
                    cache, local.dtype, local.num_kv_heads, local.head_dim, local.tp_size, self.remote.tp_size
                )
                self.cache = cache
            configure(self.sock, IO_TIMEOUT_S)
            self.ctx = SendContext(self.sock, cache, self.remote.extra, faults or FaultPlan(), ucx)
            self.sender = spec.load().Sender(self.ctx)
        except (OSError, IdleTimeout) as e:  # gone, restarting or hung: another decode worker may do
            shutdown(self.sock)
            raise ConnectionError(f"KV handshake with {address} broke off: {str(e) or 'no answer in time'}") from None
        except (ProtocolError, ValueError, KeyError, TypeError) as e:
            shutdown(self.sock)
            raise HandshakeError(f"KV handshake with {address} failed: {e}") from None
        except BaseException:
            shutdown(self.sock)
            raise
        self.name = spec.name
        self.one_sided = spec.one_sided
        self.peer_device = getattr(self.sender, "device", None)  # where a one-sided sender writes
        lease_s = self.remote.extra.get("lease_s")
        self.renew_interval_s = max(0.05, lease_s / 3) if isinstance(lease_s, (int, float)) and lease_s > 0 else 10.0
        self.broken: Exception | None = None
        # Consecutive layers queued together (sending after the prefill, or catching up) travel as
        # one unit, as large as the transport likes them (a CPU cache stored layer after layer).
        span_bytes = min(getattr(self.sender, "max_span_bytes", 0), MAX_SPAN_BYTES)
        self.max_span_bytes = span_bytes if cache.flat is not None else 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held = _NOTHING  # an item taken from the queue while joining layers, handled next
        self._transfers: dict[int, OutgoingTransfer] = {}  # open transfers: renewed, answered by ACKs
        self._lock = threading.Lock()
        threading.Thread(target=self._send_loop, name="kv-send", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="kv-acks", daemon=True).start()

    def open(
        self, transfer_id: int, dst_block_ids: list[int], dst_block_size: int, num_tokens: int, skip_tokens: int = 0
    ) -> OutgoingTransfer:
        transfer = OutgoingTransfer(self, transfer_id, dst_block_ids, dst_block_size, num_tokens, skip_tokens)
        with self._lock:
            self._transfers[transfer_id] = transfer
            broken = self.broken
        if broken is not None:
            transfer.failed = f"KV connection to {self.address} is broken: {broken}"
        self._queue.put((transfer, None))  # renew at once: the lease now covers the prefill queue
        return transfer

    def queue(self, transfer: OutgoingTransfer, item: Unit | _Done) -> None:
        self._queue.put((transfer, item))

    def forget(self, transfer: OutgoingTransfer) -> None:
        with self._lock:
            if self._transfers.get(transfer.transfer_id) is transfer:
                del self._transfers[transfer.transfer_id]

    def close(self) -> None:
        self._queue.put(None)
        shutdown(self.sock)

    # -- the sender thread ------------------------------------------------------------------------
    def _send_loop(self) -> None:
        next_renewal = time.monotonic() + self.renew_interval_s
        try:
            while True:
                try:
                    item = self._next(timeout=max(0.0, next_renewal - time.monotonic()))
                except queue.Empty:
                    item = ()
                if item is None:
                    return
                if time.monotonic() >= next_renewal:
                    self._renew_all()
                    next_renewal = time.monotonic() + self.renew_interval_s
                if item:
                    self._handle(*self._joined(item))
                if self._held is _NOTHING and self._queue.empty():
                    self.ctx.flush()  # out of work: whatever was deferred leaves now
        except Exception as e:  # noqa: BLE001 - a dead sender must fail every waiter, not hang them
            log.warning("KV sender to %s stopped: %s", self.address, e)
            self._break(e)
        finally:
            self.sender.close()

    def _next(self, timeout: float):
        if self._held is not _NOTHING:
            item, self._held = self._held, _NOTHING
            return item
        return self._queue.get(timeout=timeout)

    def _joined(self, item: tuple) -> tuple:
        """``item``, or, for a unit, one unit of it and the layers queued right behind it
        (up to ``max_span_bytes``); the first item that does not join is held for next."""
        transfer, unit = item
        if not isinstance(unit, Unit) or (unit.src.contiguous and not self.one_sided):
            return item  # (one range of one layer is read in place: joined, it would be gathered)
        layer_bytes = unit.num_tokens * self.cache.token_bytes
        while (unit.num_layers + 1) * layer_bytes <= self.max_span_bytes:
            try:
                following = self._queue.get_nowait()
            except queue.Empty:
                break
            if (
                following is None
                or following[0] is not transfer
                or not isinstance(following[1], Unit)
                or not following[1].follows(unit)
            ):
                self._held = following
                break
            unit = replace(unit, num_layers=unit.num_layers + 1)
        return transfer, unit

    def _handle(self, transfer: OutgoingTransfer, what: Unit | _Done | None) -> None:
        if transfer.cancelled:
            return
        if what is None:
            self._renew(transfer)
        elif isinstance(what, Unit):
            # A one-sided write lands in the decode worker's memory: only into blocks it holds for us.
            if (
                transfer.failed is None
                and not transfer.answered
                and (not self.one_sided or transfer.writable(IO_TIMEOUT_S))
            ):
                try:
                    self.sender.send(what)
                except (ValueError, IndexError) as e:  # a bad destination is this transfer's problem only
                    log.warning("transfer %016x: %s", transfer.transfer_id, e)
                    transfer.failed = str(e)
                    return
                transfer.nbytes += what.num_tokens * what.num_layers * self.cache.token_bytes
        elif transfer.failed is not None:
            self._fail(transfer, transfer.failed)
        elif self.ctx.faults.take("stall"):
            log.warning("fault injection: transfer %016x stalls before DONE", transfer.transfer_id)
        else:
            try:
                self.sender.flush(transfer.transfer_id)
            except (ConnectionError, TimeoutError) as e:
                self._fail(transfer, str(e))
                return
            self.ctx.send_frame(*done_frame(transfer.transfer_id, what.first_token_id, what.more_token_ids))

    def _renew(self, transfer: OutgoingTransfer) -> None:
        where = placement_digest(
            transfer.dst_block_ids, transfer.dst_block_size, transfer.num_tokens, transfer.skip_tokens
        )
        self.ctx.send_frame(FrameHeader(FrameKind.RENEW, transfer.transfer_id, checksum=where))

    def _renew_all(self) -> None:
        with self._lock:
            waiting = [t for t in self._transfers.values() if not t.finishing and not t.cancelled]
        for transfer in waiting:
            self._renew(transfer)

    def _fail(self, transfer: OutgoingTransfer, reason: str) -> None:
        self.forget(transfer)
        transfer.resolve(TransferOutcome(False, f"KV transfer failed: {reason}"))

    # -- the reader thread -----------------------------------------------------------------------
    def _ack_loop(self) -> None:
        buf = bytearray(HEADER_SIZE)
        try:
            while True:
                try:
                    header = recv_header(self.sock, buf)
                except IdleTimeout:
                    continue
                recv_payload(self.sock, header.payload_len)
                if header.kind is FrameKind.HELD:
                    with self._lock:
                        transfer = self._transfers.get(header.transfer_id)
                    if transfer is not None:
                        transfer.set_held(_holding(header.aux))
                    continue
                if header.kind is not FrameKind.ACK:
                    raise ProtocolError(f"unexpected {header.kind.name} from the decode worker")
                with self._lock:
                    transfer = self._transfers.pop(header.transfer_id, None)
                if transfer is not None:
                    outcome = _outcome(AckStatus(header.aux), self.name, transfer.nbytes)
                    if not outcome.ok and transfer.failed is None:
                        transfer.failed = outcome.reason  # reported at DONE if nobody waits for it yet
                    transfer.answered = True
                    transfer.resolve(outcome)
        except (OSError, ConnectionError, ProtocolError, ValueError) as e:
            self._break(e)

    def _break(self, error: Exception) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending, self._transfers = self._transfers, {}
        for transfer in pending.values():
            transfer.resolve(TransferOutcome(False, f"KV connection to {self.address} lost: {error}"))
        shutdown(self.sock)
        # The send thread ends and closes its transport half now, not at a next send that may never
        # come: a shm sender maps the whole of the dead peer's KV cache until then.
        self._queue.put(None)


def _holding(aux: int) -> Holding:
    """HELD's answer; a value this version does not know writes nothing."""
    try:
        return Holding(aux)
    except ValueError:
        return Holding.GONE


def _outcome(status: AckStatus, transport: str, nbytes: int) -> TransferOutcome:
    if status is AckStatus.OK:
        return TransferOutcome(True, transport=transport, nbytes=nbytes)
    return TransferOutcome(
        False, f"decode worker refused the KV transfer: {status.name}", corrupted=status is AckStatus.CHECKSUM_MISMATCH
    )


@dataclass
class _Gate:
    """One address's handshakes, one at a time; callers that waited for one that failed share its error."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    error: BaseException | None = None
    failed_at: float = float("-inf")


class KVSender:
    """The prefill worker's connections to decode workers, one per address, reopened when broken."""

    def __init__(
        self,
        local: PeerInfo,
        cache: KVCacheView,
        *,
        secret: bytes | None = None,
        ucx=None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.local = local
        self.cache = cache
        self.secret = secret
        self.ucx = ucx
        self.faults = faults or FaultPlan.from_env()
        self._conns: dict[str, KVConnection] = {}
        self._connecting: dict[str, _Gate] = {}  # one handshake at a time per address
        self._closed = False
        self._lock = threading.Lock()

    def connection(self, address: str) -> KVConnection:
        """A live, handshaken connection (blocking: run it off the event loop). Raises
        HandshakeError, or OSError when the decode worker cannot be reached or answer. A
        handshake holds up only the callers for the same address (a hung decode worker must
        not stall the others')."""
        asked = time.monotonic()
        with self._lock:
            conn = self._conns.get(address)
            if conn is not None and conn.broken is None:
                return conn
            gate = self._connecting.setdefault(address, _Gate())
        with gate.lock:
            with self._lock:
                conn = self._conns.get(address)
            if conn is not None and conn.broken is None:
                return conn  # another caller connected meanwhile
            if gate.failed_at > asked:  # the attempt we waited for failed: so do we, not after another
                raise gate.error
            if conn is not None:
                log.info("KV connection to %s was lost (%s); reconnecting", address, conn.broken)
                conn.close()
            try:
                conn = KVConnection(
                    address, self.local, self.cache, secret=self.secret, ucx=self.ucx, faults=self.faults
                )
            except (HandshakeError, OSError) as e:
                gate.error, gate.failed_at = e, time.monotonic()
                raise
            with self._lock:
                closed, self._conns[address] = self._closed, conn
            if closed:
                conn.close()
                raise ConnectionError("the KV sender is closed")
            log.info("KV connection to %s open (transport %s)", address, conn.name)
            return conn

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
