"""Blocking-socket I/O for the control channel and the TCP data path.

Sockets stay in blocking mode (no per-call timeout juggling) with kernel-level send/receive
timeouts, and receives ask for the whole buffer at once (MSG_WAITALL): a unit's payload
arrives in one system call, straight into its destination.
"""

from __future__ import annotations

import socket
import struct
import time

from pdserve.kvtransfer.protocol import HEADER_SIZE, FrameHeader, ProtocolError

_IOV_MAX = 512  # stay under the kernel's 1024 iovecs per sendmsg
MIN_FRAME_RATE_BYTES_S = 1 << 20  # a frame that started arrives at least this fast (8 Mbit/s), after the I/O timeout


class IdleTimeout(Exception):
    """Nothing arrived within the socket's timeout (not an error between frames)."""


def configure(sock: socket.socket, io_timeout_s: float) -> None:
    """Blocking mode, no Nagle delay, and ``io_timeout_s`` on every send and receive."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seconds = int(io_timeout_s)
    timeval = struct.pack("ll", seconds, int((io_timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Sends every buffer in order with sendmsg (no concatenation copy), resuming partial sends."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + _IOV_MAX])
        except BlockingIOError:
            raise TimeoutError("KV peer stopped reading") from None
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def receive_timeout_s(sock: socket.socket) -> float:
    """The socket's kernel receive timeout (``configure``'s ``io_timeout_s``); 0 for none."""
    seconds, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll")))
    return seconds + micros / 1e6


def recv_exact(sock: socket.socket, buffer) -> None:
    """Fills ``buffer`` completely; ConnectionError on EOF, TimeoutError if the peer stalls.

    The kernel's timeout bounds each receive, so a peer trickling a byte now and then would
    hold the buffer, and the blocks behind it, for as long as it likes: the whole buffer must
    arrive within the socket's receive timeout plus its size at ``MIN_FRAME_RATE_BYTES_S``
    (give or take one more receive), so a slow but steady link still carries a large unit."""
    view = memoryview(buffer).cast("B")
    size, started, budget = view.nbytes, time.monotonic(), None
    while view:
        try:
            n = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError("KV peer stalled in the middle of a frame") from None
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]
        if view:  # a partial receive (rare: MSG_WAITALL waits for the whole buffer)
            if budget is None:
                timeout = receive_timeout_s(sock)
                budget = timeout + size / MIN_FRAME_RATE_BYTES_S if timeout > 0 else float("inf")
            if time.monotonic() - started >= budget:
                raise TimeoutError("KV peer sends too slowly: a frame did not arrive in the time its size allows")


def discard(sock: socket.socket, nbytes: int, scratch: bytearray) -> None:
    """Reads and drops ``nbytes`` to keep the stream in sync after a refused frame."""
    view = memoryview(scratch)
    while nbytes:
        chunk = view[: min(nbytes, len(view))]
        recv_exact(sock, chunk)
        nbytes -= len(chunk)


def recv_header(sock: socket.socket, buf: bytearray) -> FrameHeader:
    """The next frame header; IdleTimeout if none started within the socket's timeout."""
    view = memoryview(buf)[:HEADER_SIZE]
    try:
        n = sock.recv_into(view, HEADER_SIZE, socket.MSG_WAITALL)
    except BlockingIOError:
        raise IdleTimeout() from None
    if n == 0:
        raise ConnectionError("peer closed the connection")
    if n < HEADER_SIZE:
        recv_exact(sock, view[n:])
    return FrameHeader.unpack(buf)


def recv_payload(sock: socket.socket, nbytes: int, limit: int | None = None) -> bytes:
    if limit is not None and nbytes > limit:
        raise ProtocolError(f"payload of {nbytes} bytes exceeds {limit}")
    buf = bytearray(nbytes)
    recv_exact(sock, buf)
    return bytes(buf)


def send_frame(sock: socket.socket, header: FrameHeader, payload: bytes = b"") -> None:
    send_buffers(sock, [header.pack(), payload])


def shutdown(sock: socket.socket) -> None:
    """Closes a socket so a thread blocked reading it wakes up."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
