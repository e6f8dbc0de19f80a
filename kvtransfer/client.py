"""The prefill side of KV transfer: one connection per decode worker.

The connection handshakes over TCP (which stays the control channel), learns which
transport the decode worker picked, and builds the matching data path. Units are queued by
the engine thread (one per layer as it finishes) and sent by a sender thread, so sending
layer i overlaps computing layer i+1; a reader thread collects ACKs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field

from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.paths import CudaIpcPath, DataPath, ShmPath, TcpPath, Unit, UcxPath
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.protocol import HEADER_SIZE, AckStatus, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.sockets import recv_header, recv_payload, send_frame, shutdown, split_address

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Outgoing:
    """One request's transfer on a connection."""

    connection: "KVConnection"
    transfer_id: int
    dst_block_ids: list[int]
    dst_block_size: int
    num_tokens: int
    skip_tokens: int = 0  # leading tokens the decode side already holds
    cancelled: bool = False
    units_sent: int = field(default=0)

    def send_layer(self, layer: int, src_block_ids: list[int], start: int, end: int) -> None:
        """Queues tokens [start, end) of a layer, minus what the decode side already holds."""
        start, end = max(start, self.skip_tokens), min(end, self.num_tokens)
        if start < end:
            self.connection.queue_unit(self, Unit(self.transfer_id, layer, src_block_ids, self.dst_block_ids,
                                                  self.dst_block_size, start, end))

    def finish(self, first_token_id: int) -> concurrent.futures.Future:
        return self.connection.finish(self, first_token_id)

    def cancel(self) -> None:
        """Stops sending this transfer's queued units (the request is gone)."""
        self.cancelled = True


class KVConnection:
    def __init__(self, address: str, local: PeerInfo, cache: CacheLayers, *, ucx=None,
                 faults: FaultPlan | None = None, connect_timeout: float = 5.0) -> None:
        self.address = address
        self.cache = cache
        self.faults = faults or FaultPlan()
        host, port = split_address(address)
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.remote = self._handshake(local)
        self.sock.settimeout(None)
        self.path = self._make_path(ucx)
        self.name = self.path.name
        self.broken: Exception | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._acks: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._send_loop, name="kv-send", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="kv-acks", daemon=True).start()

    # -- setup --------------------------------------------------------------------------------
    def _handshake(self, local: PeerInfo) -> PeerInfo:
        hello = local.to_json()
        try:
            send_frame(self.sock, FrameHeader(FrameKind.HELLO, payload_len=len(hello)), hello)
            header = recv_header(self.sock, bytearray(HEADER_SIZE))
            payload = recv_payload(self.sock, header.payload_len)
        except (OSError, ConnectionError, ProtocolError) as e:
            self.sock.close()
            raise HandshakeError(f"KV handshake with {self.address} failed: {e}") from None
        if header.kind is FrameKind.REJECT:
            self.sock.close()
            raise HandshakeError(f"decode worker {self.address} refused the KV handshake: {payload.decode(errors='replace')}")
        if header.kind is not FrameKind.HELLO_OK:
            self.sock.close()
            raise HandshakeError(f"decode worker {self.address} answered the handshake with {header.kind.name}")
        remote = PeerInfo.from_json(payload)
        local.check_compatible(remote)
        return remote

    def _make_path(self, ucx) -> DataPath:
        extra = self.remote.extra
        transport = extra.get("transport", "tcp")
        if transport == "tcp":
            return TcpPath(self.sock, self.cache, self.faults)
        if transport == "shm":
            from pdserve.kvtransfer.shm import MappedKVPool

            self._pool = MappedKVPool(extra["shm_name"], extra["shm_bytes"], self.cache.num_layers)
            return ShmPath(self.sock, self.cache, self.faults, self._pool.layers)
        if transport == "ucx":
            if ucx is None:
                raise HandshakeError("the decode worker chose UCX but UCX is not running here")
            peer = bytes.fromhex(extra["ucx_address"])
            ucx.connect(peer).result(timeout=10)
            return UcxPath(self.sock, self.cache, self.faults, ucx, peer, extra["ucx_tag"])
        if transport == "cuda_ipc":
            from pdserve.kvtransfer.cuda_ipc import open_pool

            return CudaIpcPath(self.sock, self.cache, self.faults, open_pool(extra["cuda_ipc"]))
        raise HandshakeError(f"decode worker {self.address} chose an unknown transport {transport!r}")

    # -- transfers ------------------------------------------------------------------------------
    def open(self, transfer_id: int, dst_block_ids: list[int], dst_block_size: int, num_tokens: int,
             skip_tokens: int = 0) -> Outgoing:
        return Outgoing(self, transfer_id, list(dst_block_ids), dst_block_size, num_tokens, skip_tokens)

    def queue_unit(self, transfer: Outgoing, unit: Unit) -> None:
        self._queue.put((transfer, unit))

    def finish(self, transfer: Outgoing, first_token_id: int) -> concurrent.futures.Future:
        """Queues DONE; the future resolves to the decode side's AckStatus."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.broken:
                future.set_exception(ConnectionError(f"KV connection to {self.address} is broken: {self.broken}"))
                return future
            self._acks[transfer.transfer_id] = future
        self._queue.put((transfer, first_token_id))
        return future

    def close(self) -> None:
        self._queue.put(None)
        shutdown(self.sock)

    # -- threads --------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                transfer, what = item
                if transfer.cancelled:
                    continue
                if isinstance(what, Unit):
                    self._send_unit(transfer, what)
                elif transfer.units_sent < 0:  # a unit could not be read: report instead of DONE
                    self._resolve(transfer.transfer_id, ValueError("KV blocks of this request could not be read"))
                elif self.faults.take("stall"):
                    log.warning("fault injection: transfer %016x stalls before DONE", transfer.transfer_id)
                else:
                    send_frame(self.sock, FrameHeader(FrameKind.DONE, transfer.transfer_id, aux=what))
        except Exception as e:  # noqa: BLE001 - a dead sender must fail every waiter, not hang them
            log.warning("KV sender to %s stopped: %s", self.address, e)
            self._break(e)

    def _send_unit(self, transfer: Outgoing, unit: Unit) -> None:
        if transfer.units_sent < 0:
            return
        try:
            self.path.send(unit)
            transfer.units_sent += 1
        except (ValueError, IndexError) as e:  # a bad range is this transfer's problem, not the connection's
            log.warning("transfer %016x: %s", transfer.transfer_id, e)
            transfer.units_sent = -1

    def _ack_loop(self) -> None:
        buf = bytearray(HEADER_SIZE)
        try:
            while True:
                header = recv_header(self.sock, buf)
                recv_payload(self.sock, header.payload_len)
                if header.kind is not FrameKind.ACK:
                    raise ProtocolError(f"unexpected {header.kind.name} from the decode worker")
                self._resolve(header.transfer_id, AckStatus(header.aux))
        except (OSError, ConnectionError, ProtocolError, ValueError) as e:
            self._break(e)

    def _resolve(self, transfer_id: int, outcome: AckStatus | Exception) -> None:
        with self._lock:
            future = self._acks.pop(transfer_id, None)
        if future is None or future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _break(self, error: Exception) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending, self._acks = self._acks, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionError(f"KV connection to {self.address} lost: {error}"))
        shutdown(self.sock)

