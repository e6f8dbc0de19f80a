"""Blocking-socket helpers: scatter/gather I/O straight from and into cache memory."""

from __future__ import annotations

import select
import socket

from pdserve.kvtransfer.protocol import HEADER_SIZE, FrameHeader

_IOV_MAX = 512  # stay under the kernel's 1024 iovecs per sendmsg


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Sends every buffer in order with sendmsg (no concatenation copy), resuming partial sends."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    view = view.cast("B")
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def discard(sock: socket.socket, nbytes: int, scratch: bytearray) -> None:
    """Reads and drops ``nbytes`` to keep the stream in sync after a refused frame."""
    view = memoryview(scratch)
    while nbytes:
        n = sock.recv_into(view[: min(nbytes, len(view))])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        nbytes -= n


def recv_header(sock: socket.socket, buf: bytearray) -> FrameHeader:
    recv_into_exact(sock, memoryview(buf)[:HEADER_SIZE])
    return FrameHeader.unpack(buf)


def recv_payload(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def send_frame(sock: socket.socket, header: FrameHeader, payload: bytes = b"") -> None:
    send_buffers(sock, [header.pack(), payload])


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    readable, _, _ = select.select([sock], [], [], timeout)
    return bool(readable)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def shutdown(sock: socket.socket) -> None:
    """Closes a socket so a thread blocked reading it wakes up."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
