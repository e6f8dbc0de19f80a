"""KV transfer over TCP: blocking sockets on dedicated threads, zero-copy on both ends.

The prefill side keeps one connection per decode worker. A sender thread turns queued units
into DATA frames whose payload goes out with ``sendmsg`` straight from the cache; a reader
thread collects ACKs. The decode side runs one thread per connection that receives each
payload with ``recv_into`` straight into the granted blocks. Both ends are blocking sockets
on their own threads: faster here than asyncio streams (~7x) and never in the way of the
gRPC event loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
from dataclasses import dataclass

from pdserve.kvtransfer.layout import CacheLayers, checksum
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.protocol import HEADER_SIZE, AckStatus, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sockets import (
    discard, recv_header, recv_into_exact, recv_payload, send_buffers, send_frame, split_address, wait_readable,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 10.0  # once a frame has started, the rest must arrive within this


def check_auth(local: PeerInfo, peer: PeerInfo) -> None:
    import hmac

    if local.auth_token and not hmac.compare_digest(local.auth_token, peer.auth_token):
        raise HandshakeError("unauthenticated peer: cluster token mismatch")


# -- decode side ------------------------------------------------------------------------------
class TcpKVServer:
    name = "tcp"

    def __init__(self, receiver: KVReceiver, local: PeerInfo, host: str, port: int, max_tokens: int) -> None:
        self.receiver = receiver
        self.local = local
        self.max_payload = max_tokens * receiver.cache.token_bytes
        self._listener = socket.create_server((host, port), backlog=64, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for conn in list(self._conns):
            _shutdown(conn)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                if not wait_readable(self._listener, 0.5):
                    continue
                conn, peer = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        self._conns.add(conn)
        try:
            if self._handshake(conn, peer):
                self._frames(conn)
        except (ConnectionError, socket.timeout, OSError) as e:
            if not self._stopped.is_set():
                log.info("KV connection from %s closed: %s", peer, e)
        except ProtocolError as e:
            log.warning("KV connection from %s refused: protocol error: %s", peer, e)
            self.receiver.counters["protocol_errors"] += 1
        finally:
            self._conns.discard(conn)
            _shutdown(conn)

    def _handshake(self, conn: socket.socket, peer: tuple) -> bool:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        buf = bytearray(HEADER_SIZE)
        header = recv_header(conn, buf)
        if header.kind is not FrameKind.HELLO:
            raise ProtocolError(f"expected HELLO, got {header.kind.name}")
        try:
            remote = PeerInfo.from_json(recv_payload(conn, header.payload_len))
            check_auth(self.local, remote)
            self.local.check_compatible(remote)
        except HandshakeError as e:
            log.warning("KV handshake from %s refused: %s", peer, e)
            self.receiver.counters["handshakes_refused"] += 1
            reason = str(e).encode()
            send_frame(conn, FrameHeader(FrameKind.REJECT, payload_len=len(reason)), reason)
            return False
        reply = self.local.public().to_json()
        send_frame(conn, FrameHeader(FrameKind.HELLO_OK, payload_len=len(reply)), reply)
        return True

    def _frames(self, conn: socket.socket) -> None:
        buf = bytearray(HEADER_SIZE)
        scratch = bytearray(1 << 20)
        while not self._stopped.is_set():
            conn.settimeout(None)
            if not wait_readable(conn, 0.5):
                continue
            conn.settimeout(IO_TIMEOUT_S)
            header = recv_header(conn, buf)
            if header.kind is FrameKind.DATA:
                self._data(conn, header, scratch)
            elif header.kind is FrameKind.DONE:
                self._done(conn, header)
            else:
                raise ProtocolError(f"unexpected {header.kind.name} frame")

    def _data(self, conn: socket.socket, h: FrameHeader, scratch: bytearray) -> None:
        if h.payload_len > self.max_payload:
            raise ProtocolError(f"DATA frame of {h.payload_len} bytes exceeds the {self.max_payload}-byte limit")
        grant = self.receiver.lookup(h.transfer_id)
        problem = "unknown or finished transfer" if grant is None else self.receiver.check_range(grant, h.layer, h.start, h.end, h.payload_len)
        if problem is not None or not self.receiver.begin_write(grant):
            log.warning("KV frame for transfer %016x refused: %s", h.transfer_id, problem or "transfer ended")
            self.receiver.counters["frames_refused"] += 1
            discard(conn, h.payload_len, scratch)
            return
        ok = None
        try:
            views, commit = self.receiver.cache.write_target(h.layer, grant.block_ids, h.start, h.end)
            for view in views:
                recv_into_exact(conn, view)
            commit()
            ok = checksum(views) == h.checksum
        finally:
            self.receiver.end_write(grant, h.layer, h.start, h.end, ok)

    def _done(self, conn: socket.socket, h: FrameHeader) -> None:
        recv_payload(conn, h.payload_len)
        grant = self.receiver.lookup(h.transfer_id)
        status = AckStatus.UNKNOWN_TRANSFER if grant is None else self.receiver.finish(grant, h.aux, self.name)
        send_frame(conn, FrameHeader(FrameKind.ACK, transfer_id=h.transfer_id, aux=int(status)))


# -- prefill side -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Unit:
    transfer_id: int
    layer: int
    block_ids: list[int]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class _Done:
    transfer_id: int
    first_token_id: int


class TcpKVConnection:
    """One handshaken connection to a decode worker, with a sender and an ACK-reader thread."""

    name = "tcp"

    def __init__(self, address: str, local: PeerInfo, cache: CacheLayers, connect_timeout: float = 5.0) -> None:
        self.address = address
        self.cache = cache
        host, port = split_address(address)
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.remote = self._handshake(local)
        self.sock.settimeout(None)
        self.broken: Exception | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._acks: dict[int, concurrent.futures.Future] = {}
        self._failed: dict[int, Exception] = {}  # transfers whose units could not be sent
        self._lock = threading.Lock()
        threading.Thread(target=self._send_loop, name="kv-tcp-send", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="kv-tcp-acks", daemon=True).start()

    def _handshake(self, local: PeerInfo) -> PeerInfo:
        hello = local.to_json()
        try:
            send_frame(self.sock, FrameHeader(FrameKind.HELLO, payload_len=len(hello)), hello)
            header = recv_header(self.sock, bytearray(HEADER_SIZE))
            payload = recv_payload(self.sock, header.payload_len)
        except (OSError, ConnectionError) as e:
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

    def send_layer(self, transfer_id: int, layer: int, block_ids: list[int], start: int, end: int) -> None:
        """Queues tokens [start, end) of one layer; the caller keeps the blocks alive until ``finish`` resolves."""
        self._queue.put(_Unit(transfer_id, layer, block_ids, start, end))

    def finish(self, transfer_id: int, first_token_id: int) -> concurrent.futures.Future:
        """Queues DONE; the future resolves to the decode side's AckStatus."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.broken:
                future.set_exception(ConnectionError(f"KV connection to {self.address} is broken: {self.broken}"))
                return future
            self._acks[transfer_id] = future
        self._queue.put(_Done(transfer_id, first_token_id))
        return future

    def close(self) -> None:
        self._queue.put(None)
        _shutdown(self.sock)

    def _send_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, _Unit):
                    self._send_unit(item)
                elif item.transfer_id in self._failed:
                    error = self._failed.pop(item.transfer_id)
                    with self._lock:
                        future = self._acks.pop(item.transfer_id, None)
                    if future is not None:
                        future.set_exception(error)
                else:
                    send_frame(self.sock, FrameHeader(FrameKind.DONE, item.transfer_id, aux=item.first_token_id))
        except OSError as e:
            self._break(e)

    def _send_unit(self, unit: _Unit) -> None:
        if unit.transfer_id in self._failed:
            return
        try:
            views = self.cache.read(unit.layer, unit.block_ids, unit.start, unit.end)
        except ValueError as e:  # a bad range is this transfer's problem, not the connection's
            self._failed[unit.transfer_id] = e
            return
        header = FrameHeader(
            FrameKind.DATA, unit.transfer_id, unit.layer, unit.start, unit.end,
            payload_len=sum(len(v) for v in views), checksum=checksum(views),
        )
        send_buffers(self.sock, [header.pack(), *views])

    def _ack_loop(self) -> None:
        buf = bytearray(HEADER_SIZE)
        try:
            while True:
                header = recv_header(self.sock, buf)
                recv_payload(self.sock, header.payload_len)
                if header.kind is not FrameKind.ACK:
                    raise ProtocolError(f"unexpected {header.kind.name} from the decode worker")
                with self._lock:
                    future = self._acks.pop(header.transfer_id, None)
                if future is not None:
                    future.set_result(AckStatus(header.aux))
        except (OSError, ConnectionError, ProtocolError, ValueError) as e:
            self._break(e)

    def _break(self, error: Exception) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending, self._acks = self._acks, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionError(f"KV connection to {self.address} lost: {error}"))
        _shutdown(self.sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
