"""The decode side of KV transfer: a TCP control channel per prefill peer, and the data
paths behind it (inline TCP payloads, UCX receives, one-sided writes).

Each connection starts with a handshake: the prefill worker sends its PeerInfo, we check
compatibility and credentials, pick the best transport both offer and answer with what the
peer needs to use it (our UCX worker address, our shared-memory pool, ...). Then frames:
DATA (TCP payload, received straight into the granted blocks), UCX_DATA (the same bytes
follow over UCX; we post receives at their destination), WRITTEN (the peer already wrote
into our shared pool; we verify), DONE (verify coverage and checksums, ACK).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
from dataclasses import replace

from pdserve.kvtransfer.integrity import checksum, device_checksum
from pdserve.kvtransfer.negotiate import choose
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo
from pdserve.kvtransfer.protocol import HEADER_SIZE, AckStatus, FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.receiver import Grant, KVReceiver
from pdserve.kvtransfer.sockets import (
    discard, recv_header, recv_into_exact, recv_payload, send_frame, shutdown, wait_readable,
)
from pdserve.kvtransfer.ucx import UcxWorkerThread

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 10.0  # once a frame (or a UCX unit) has started, the rest must arrive within this


def check_auth(local: PeerInfo, peer: PeerInfo) -> None:
    if local.auth_token and not hmac.compare_digest(
        local.auth_token.encode(errors="surrogatepass"), str(peer.auth_token).encode(errors="surrogatepass")
    ):
        raise HandshakeError("unauthenticated peer: cluster credential missing or wrong")


class KVServer:
    def __init__(self, receiver: KVReceiver, local: PeerInfo, host: str, port: int, max_tokens: int,
                 ucx: UcxWorkerThread | None = None) -> None:
        self.receiver = receiver
        self.local = local
        self.ucx = ucx
        self.max_payload = max_tokens * receiver.cache.token_bytes
        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for conn in list(self._conns):
            shutdown(conn)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                if not wait_readable(self._listener, 0.5):
                    continue
                conn, peer = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_Connection(self, conn, peer).serve, name="kv-conn", daemon=True).start()


class _Connection:
    def __init__(self, server: KVServer, sock: socket.socket, peer: tuple) -> None:
        self.server = server
        self.receiver = server.receiver
        self.sock = sock
        self.peer = peer
        self.transport = "tcp"
        self.ucx_tag = 0
        self._send_lock = threading.Lock()  # ACKs may come from the UCX thread too

    def serve(self) -> None:
        self.server._conns.add(self.sock)
        try:
            if self._handshake():
                self._frames()
        except (ConnectionError, socket.timeout, OSError) as e:
            if not self.server._stopped.is_set():
                log.info("KV connection from %s closed: %s", self.peer, e)
        except ProtocolError as e:
            log.warning("KV connection from %s dropped: protocol error: %s", self.peer, e)
            self.receiver.counters["protocol_errors"] += 1
        except Exception as e:  # noqa: BLE001 - whatever a peer sends, only its connection ends
            log.warning("KV connection from %s dropped: %s: %s", self.peer, type(e).__name__, e)
            self.receiver.counters["protocol_errors"] += 1
        finally:
            self.server._conns.discard(self.sock)
            shutdown(self.sock)

    def _handshake(self) -> bool:
        self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        header = recv_header(self.sock, bytearray(HEADER_SIZE))
        if header.kind is not FrameKind.HELLO:
            raise ProtocolError(f"expected HELLO, got {header.kind.name}")
        local = self.server.local
        try:
            remote = PeerInfo.from_json(recv_payload(self.sock, header.payload_len))
            check_auth(local, remote)
            local.check_compatible(remote)
            self.transport = choose(local, remote)
        except HandshakeError as e:
            log.warning("KV handshake from %s refused: %s", self.peer, e)
            self.receiver.counters["handshakes_refused"] += 1
            reason = str(e).encode("utf-8", "backslashreplace")
            send_frame(self.sock, FrameHeader(FrameKind.REJECT, payload_len=len(reason)), reason)
            return False
        self.ucx_tag = secrets.randbits(23) + 1
        extra = {**local.extra, "transport": self.transport, "ucx_tag": self.ucx_tag}
        reply = replace(local.public(), extra=extra).to_json()
        send_frame(self.sock, FrameHeader(FrameKind.HELLO_OK, payload_len=len(reply)), reply)
        log.info("KV connection from %s: transport %s", self.peer, self.transport)
        return True

    def _frames(self) -> None:
        buf = bytearray(HEADER_SIZE)
        scratch = bytearray(1 << 20)
        handlers = {
            FrameKind.DATA: lambda h: self._data(h, scratch),
            FrameKind.UCX_DATA: self._ucx_data,
            FrameKind.WRITTEN: self._written,
            FrameKind.DONE: self._done,
        }
        while not self.server._stopped.is_set():
            self.sock.settimeout(None)
            if not wait_readable(self.sock, 0.5):
                continue
            self.sock.settimeout(IO_TIMEOUT_S)
            header = recv_header(self.sock, buf)
            handler = handlers.get(header.kind)
            if handler is None:
                raise ProtocolError(f"unexpected {header.kind.name} frame")
            handler(header)

    # -- units ----------------------------------------------------------------------------------
    def _admit(self, h: FrameHeader, nbytes: int) -> Grant | None:
        """The grant a unit may write into, or None (refused and logged)."""
        grant = self.receiver.lookup(h.transfer_id)
        problem = "unknown or finished transfer" if grant is None else self.receiver.check_range(grant, h.layer, h.start, h.end, nbytes)
        if problem is None and self.receiver.begin_write(grant):
            return grant
        log.warning("KV %s unit for transfer %016x refused: %s", h.kind.name, h.transfer_id, problem or "transfer ended")
        self.receiver.counters["units_refused"] += 1
        return None

    def _data(self, h: FrameHeader, scratch: bytearray) -> None:
        if h.payload_len > self.server.max_payload:
            raise ProtocolError(f"DATA frame of {h.payload_len} bytes exceeds the {self.server.max_payload}-byte limit")
        grant = self._admit(h, h.payload_len)
        if grant is None:
            discard(self.sock, h.payload_len, scratch)
            return
        ok = None
        try:
            views, commit = self.receiver.cache.write_target(h.layer, grant.block_ids, h.start, h.end)
            for view in views:
                recv_into_exact(self.sock, view)
            commit()
            ok = checksum(views) == h.checksum
        finally:
            self.receiver.end_write(grant, h.layer, h.start, h.end, ok)

    def _written(self, h: FrameHeader) -> None:
        """The peer wrote [start, end) of a layer into our shared pool; verify it."""
        if self.transport not in ("shm", "cuda_ipc"):
            raise ProtocolError(f"WRITTEN frame on a {self.transport} connection")
        grant = self._admit(h, (h.end - h.start) * self.receiver.cache.token_bytes)
        if grant is None:
            return
        ok = None
        try:
            cache = self.receiver.cache
            if cache.on_host:
                ok = checksum(cache.read(h.layer, grant.block_ids, h.start, h.end)) == h.checksum
            else:
                ok = device_checksum(cache.device_rows(h.layer, grant.block_ids, h.start, h.end)) == h.checksum
        finally:
            self.receiver.end_write(grant, h.layer, h.start, h.end, ok)

    def _ucx_data(self, h: FrameHeader) -> None:
        """Post UCX receives for the unit at its destination; they complete on the UCX thread."""
        if self.transport != "ucx" or self.server.ucx is None:
            raise ProtocolError(f"UCX_DATA frame on a {self.transport} connection")
        grant = self._admit(h, (h.end - h.start) * self.receiver.cache.token_bytes)
        if grant is None:
            return  # the sender's messages stay unmatched and are dropped with its endpoint
        views, commit = self.receiver.cache.write_target(h.layer, grant.block_ids, h.start, h.end)
        tags = [(self.ucx_tag << 40) | ((h.aux + i) & ((1 << 40) - 1)) for i in range(len(views))]
        future = self.server.ucx.recv(list(zip(views, tags)))

        def landed(f) -> None:
            ok = None
            if not f.cancelled() and f.exception() is None:
                commit()
                ok = checksum(views) == h.checksum
            self.receiver.end_write(grant, h.layer, h.start, h.end, ok)

        future.add_done_callback(landed)
        loop = self.receiver.loop
        loop.call_soon_threadsafe(loop.call_later, IO_TIMEOUT_S, lambda: future.done() or self.server.ucx.cancel(future))

    def _done(self, h: FrameHeader) -> None:
        recv_payload(self.sock, h.payload_len)
        grant = self.receiver.lookup(h.transfer_id)
        if grant is None:
            self._ack(h.transfer_id, AckStatus.UNKNOWN_TRANSFER)
            return
        status = self.receiver.finish(grant, h.aux, self.transport, reply=lambda s: self._ack(h.transfer_id, s))
        if status is not None:
            self._ack(h.transfer_id, status)

    def _ack(self, transfer_id: int, status: AckStatus) -> None:
        try:
            with self._send_lock:
                send_frame(self.sock, FrameHeader(FrameKind.ACK, transfer_id=transfer_id, aux=int(status)))
        except OSError as e:
            log.info("could not acknowledge transfer %016x: %s", transfer_id, e)

