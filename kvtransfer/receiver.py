"""The decode side of the KV handoff: accepts prefill workers' connections and lands their K/V
in granted blocks.

Each connection starts with the handshake (credential, compatibility, the transport, whose
receiving half is then built for it) and carries frames: the transport's units (DATA, WRITTEN
or UCX_DATA), RENEW (a transfer is still wanted: extend its lease) and DONE (verify coverage
and checksums, then ACK). Whatever a peer sends, only its own connection ends.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

from pdserve.kvtransfer import registry
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, reject, server_handshake
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.protocol import (
    HEADER_SIZE,
    AckStatus,
    FrameHeader,
    FrameKind,
    Holding,
    ProtocolError,
    done_tokens,
    placement_digest,
)
from pdserve.kvtransfer.sockets import IdleTimeout, configure, recv_header, recv_payload, send_frame, shutdown
from pdserve.kvtransfer.transport_api import IO_TIMEOUT_S, ReceiveContext

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0  # for the whole handshake, however slowly a peer trickles its bytes
# Connections still proving their credential, in all and from one address. Past either, the
# oldest of them is dropped for the newcomer: a real peer's handshake takes milliseconds, so
# connections held open without a word cannot keep it out (nor one address everyone else).
MAX_HANDSHAKING = 64
MAX_HANDSHAKING_PER_HOST = 16
DROP_WARNING_EVERY_S = 10.0


class KVReceiver:
    def __init__(
        self,
        ledger: GrantLedger,
        cache: KVCacheView,
        local: PeerInfo,
        host: str,
        port: int,
        *,
        secret: bytes | None = None,
        ucx=None,
    ) -> None:
        self.ledger = ledger
        self.cache = cache
        self.local = local
        self.secret = secret
        self.ucx = ucx
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        every = host == "::" and socket.has_dualstack_ipv6()  # IPv4 peers too, as the gRPC server on [::]
        self._listener = socket.create_server((host, port), family=family, backlog=64, dualstack_ipv6=every)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._handshaking: dict[socket.socket, tuple[float, str]] = {}  # in their handshake: (deadline, host)
        self._dropped, self._warned_at = 0, float("-inf")  # dropped handshakes not warned about yet
        self._thread = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)

    @property
    def counters(self):
        return self.ledger.counters

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
                readable, _, _ = select.select([self._listener], [], [], 0.5)
                self._expire_handshakes()
                if not readable:
                    continue
                conn, peer = self._listener.accept()
            except (OSError, ValueError):
                return
            self._make_room(peer[0])
            self._handshaking[conn] = (time.monotonic() + HANDSHAKE_TIMEOUT_S, peer[0])
            try:
                threading.Thread(target=_Connection(self, conn, peer).serve, name="kv-conn", daemon=True).start()
            except RuntimeError as e:  # no thread for it (a process limit): drop it, keep listening
                log.warning("KV connection from %s dropped: %s", peer, e)
                self._handshaking.pop(conn, None)
                shutdown(conn)

    def _make_room(self, host: str) -> None:
        """Drops the oldest handshake from ``host`` (or of all) when a newcomer would pass the caps."""
        pending = list(self._handshaking.items())
        mine = [item for item in pending if item[1][1] == host]
        for crowd, cap in ((mine, MAX_HANDSHAKING_PER_HOST), (pending, MAX_HANDSHAKING)):
            if len(crowd) >= cap:
                oldest, (_, from_host) = min(crowd, key=lambda item: item[1][0])
                self.ledger.counters.add("handshakes_refused")
                self._end_handshake(oldest)
                self._dropped += 1
                now = time.monotonic()
                if now - self._warned_at >= DROP_WARNING_EVERY_S:
                    log.warning(
                        "%d KV connections dropped in their handshake to make room (last from %s): "
                        "%d in their handshake, at most %d from one address",
                        self._dropped,
                        from_host,
                        MAX_HANDSHAKING,
                        MAX_HANDSHAKING_PER_HOST,
                    )
                    self._dropped, self._warned_at = 0, now
                return

    def _expire_handshakes(self) -> None:
        """Wakes the threads of handshakes past their deadline; each ends its connection."""
        now = time.monotonic()
        for sock, (deadline, _) in list(self._handshaking.items()):
            if now >= deadline:
                self._end_handshake(sock)

    def _end_handshake(self, sock: socket.socket) -> None:
        if self._handshaking.pop(sock, None) is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its thread wakes and ends the connection
            except OSError:
                pass


class _Connection:
    def __init__(self, server: KVReceiver, sock: socket.socket, peer: tuple) -> None:
        self.server = server
        self.ledger = server.ledger
        self.sock = sock
        self.peer = peer
        self.transport = ""
        self.receiver = None
        self._ack_lock = threading.Lock()  # ACKs may come from the UCX thread too

    def serve(self) -> None:
        self.server._conns.add(self.sock)
        try:
            if self._handshake():
                self._frames()
        except (ConnectionError, TimeoutError, OSError) as e:
            if not self.server._stopped.is_set():
                log.info("KV connection from %s closed: %s", self.peer, e)
        except ProtocolError as e:
            log.warning("KV connection from %s dropped: protocol error: %s", self.peer, e)
            self.ledger.counters.add("protocol_errors")
        except Exception as e:  # noqa: BLE001 - whatever a peer sends, only its connection ends
            log.warning("KV connection from %s dropped: %s: %s", self.peer, type(e).__name__, e)
            self.ledger.counters.add("protocol_errors")
        finally:
            if self.receiver is not None:
                self.receiver.close()
            self.server._conns.discard(self.sock)
            shutdown(self.sock)

    def _handshake(self) -> bool:
        configure(self.sock, HANDSHAKE_TIMEOUT_S)
        ctx = ReceiveContext(
            self.sock,
            self.server.cache,
            self.ledger,
            self.server.ucx,
            str(self.peer),
            self.server.local.extra,
        )

        def reply_extra(transport: str) -> dict:
            self.receiver = registry.get(transport).load().Receiver(ctx)
            return {**self.receiver.hello_extra(), "lease_s": self.ledger.lease_s}

        try:
            _, self.transport = server_handshake(self.sock, self.server.local, self.server.secret, reply_extra)
        except HandshakeError as e:
            log.warning("KV handshake from %s refused: %s", self.peer, e)
            self.ledger.counters.add("handshakes_refused")
            reject(self.sock, e)
            return False
        finally:
            self.server._handshaking.pop(self.sock, None)
        log.info("KV connection from %s: transport %s", self.peer, self.transport)
        configure(self.sock, IO_TIMEOUT_S)
        return True

    def _frames(self) -> None:
        buf = bytearray(HEADER_SIZE)
        handlers = {FrameKind.DONE: self._done, FrameKind.RENEW: self._renew, **self.receiver.handlers}
        check = getattr(self.receiver, "check", lambda: None)
        while not self.server._stopped.is_set():
            try:
                header = recv_header(self.sock, buf)
            except IdleTimeout:
                check()
                continue
            handler = handlers.get(header.kind)
            if handler is None:
                raise ProtocolError(f"unexpected {header.kind.name} frame on a {self.transport} connection")
            handler(header)
            check()

    def _renew(self, h: FrameHeader) -> None:
        recv_payload(self.sock, h.payload_len)
        grant = self.ledger.lookup(h.transfer_id)
        one_sided = registry.get(self.transport).one_sided  # its writer waits for HELD before writing into our memory
        if (
            one_sided
            and grant is not None
            and h.checksum
            != placement_digest(grant.block_ids, self.server.cache.block_size, grant.num_tokens, grant.skip_tokens)
        ):
            log.warning("transfer %016x: the writer's blocks are not its grant's: it may not write", h.transfer_id)
            self._reply(FrameKind.HELD, h.transfer_id, Holding.MISPLACED)
            return
        if grant is not None:
            self.ledger.renew(grant)
        if one_sided:
            tid = h.transfer_id
            held = grant is not None and self.ledger.tell_writer_at_end(
                grant, lambda: self._reply(FrameKind.HELD, tid, Holding.GONE)
            )
            self._reply(FrameKind.HELD, tid, Holding.HELD if held else Holding.GONE)

    def _done(self, h: FrameHeader) -> None:
        first, more, intact = done_tokens(h, recv_payload(self.sock, h.payload_len))  # more: n > 1's other choices
        grant = self.ledger.lookup(h.transfer_id)
        if grant is None:
            self._ack(h.transfer_id, AckStatus.UNKNOWN_TRANSFER)
            return
        status = self.ledger.finish(
            grant,
            first,
            self.transport,
            reply=lambda s: self._ack(h.transfer_id, s),
            more_token_ids=more,
            tokens_intact=intact,
        )
        if status is not None:
            self._ack(h.transfer_id, status)

    def _ack(self, transfer_id: int, status: AckStatus) -> None:
        self._reply(FrameKind.ACK, transfer_id, int(status))

    def _reply(self, kind: FrameKind, transfer_id: int, aux: int) -> None:
        try:
            with self._ack_lock:
                send_frame(self.sock, FrameHeader(kind, transfer_id=transfer_id, aux=aux))
        except OSError as e:
            log.info("could not answer transfer %016x (%s): %s", transfer_id, kind.name, e)
