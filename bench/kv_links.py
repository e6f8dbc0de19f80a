"""What ``kv_transfer_bench`` measures side by side: one payload moved by memcpy, a raw TCP
socket, raw UCX, and each pdserve transport (the real sender here, the real receiver in a
child process as a decode worker runs it, or in this process).
Every ``sample()`` moves the whole payload into zeroed memory, checks what landed, and returns
the seconds it took."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from pdserve.engine.host_memory import host_zeros
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.kv_connector import TransferOutcome
from pdserve.kvtransfer import registry
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.handshake import PeerInfo
from pdserve.kvtransfer.integrity import checksum
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVConnection

IO_TIMEOUT_S = 60.0  # every wait here is bounded by this


class Waiter:
    """One outcome, reported from another thread."""

    def __init__(self) -> None:
        self.event, self.outcome = threading.Event(), None

    def __call__(self, outcome: TransferOutcome) -> None:
        self.outcome = outcome
        self.event.set()

    def wait(self, what: str) -> TransferOutcome:
        if not self.event.wait(IO_TIMEOUT_S):
            raise RuntimeError(f"{what}: no outcome within {IO_TIMEOUT_S} s")
        if not self.outcome.ok:
            raise RuntimeError(f"{what}: {self.outcome.reason}")
        return self.outcome


def layer_checksums(cache: KVCacheView, blocks: list[int], num_tokens: int) -> list[int]:
    sums = []
    for layer in range(cache.num_layers):
        data = cache.read(layer, cache.slots(blocks, 0, num_tokens))
        sums.append(checksum(data.data))
        data.release()
    return sums


class DecodeSide:
    """A grant ledger and a KV receiver with a cache of ``num_blocks`` (in a shared pool for shm)."""

    def __init__(self, transport: str, layout: KVLayout, num_blocks: int, info: PeerInfo, ucx) -> None:
        spec = registry.get(transport)
        self.pool = spec.load().make_pool(layout, num_blocks, torch.device("cpu")) if spec.pool else None
        self.tensor = self.pool.tensor if self.pool else host_zeros(layout.shape(num_blocks), layout.dtype)
        self.cache = KVCacheView(list(self.tensor.unbind(0)), layout.block_size, layout.token_bytes)
        self.ledger = GrantLedger(layout.num_layers, layout.token_bytes, lease_s=IO_TIMEOUT_S)
        info = replace(info, extra={**info.extra, **(self.pool.describe() if self.pool else {})})
        self.receiver = KVReceiver(
            self.ledger, self.cache, info, "127.0.0.1", 0, ucx=ucx if transport == "ucx" else None
        )
        self.receiver.start()
        self.address = f"127.0.0.1:{self.receiver.port}"

    def zero(self) -> None:
        self.tensor.view(torch.uint8).numpy().fill(0)  # numpy: no torch worker threads left spinning

    def grant(self, blocks: list[int], num_tokens: int) -> tuple[int, Waiter]:
        waiter = Waiter()
        return self.ledger.grant(blocks, num_tokens, 0, waiter), waiter

    def checksums(self, blocks: list[int], num_tokens: int) -> list[int]:
        return layer_checksums(self.cache, blocks, num_tokens)

    def close(self) -> None:
        self.receiver.stop()
        if self.pool:
            self.pool.close()


class RemoteDecodeSide:
    """A ``DecodeSide`` in a child process, as pdserve deploys a decode worker: its receiving
    threads (and UCX's) do not share the prefill side's interpreter lock. Same methods."""

    def __init__(self, transport: str, layout: KVLayout, num_blocks: int, info: PeerInfo) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(
            target=_serve_decode_side, args=(child, transport, layout, num_blocks, info), daemon=True
        )
        self._process.start()
        child.close()
        try:
            self.address = self._answer("start")  # the child's first word: its address, or why it failed
        except BaseException:
            self.close()
            raise

    def _call(self, *command):
        try:
            self._pipe.send(command)
        except OSError:
            raise RuntimeError(f"decode side exited (code {self._process.exitcode})") from None
        return self._answer(command[0])

    def _answer(self, what: str):
        # Longer than any wait the child makes itself, so its own timeout is what gets reported.
        try:
            if not self._pipe.poll(2 * IO_TIMEOUT_S):
                raise RuntimeError(f"decode side: no answer to {what} within {2 * IO_TIMEOUT_S} s")
            ok, value = self._pipe.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"decode side exited during {what} (code {self._process.exitcode})") from None
        if not ok:
            raise RuntimeError(f"decode side: {value}")
        return value

    def zero(self) -> None:
        self._call("zero")

    def grant(self, blocks: list[int], num_tokens: int) -> tuple[int, "_RemoteWaiter"]:
        transfer_id = self._call("grant", blocks, num_tokens)
        return transfer_id, _RemoteWaiter(self, transfer_id)

    def checksums(self, blocks: list[int], num_tokens: int) -> list[int]:
        return self._call("checksums", blocks, num_tokens)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._call("close")
            except (OSError, EOFError, RuntimeError):
                pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


class _RemoteWaiter:
    def __init__(self, side: RemoteDecodeSide, transfer_id: int) -> None:
        self.side, self.transfer_id = side, transfer_id

    def wait(self, what: str) -> TransferOutcome:
        return self.side._call("wait", self.transfer_id, what)


def _serve_decode_side(pipe, transport: str, layout: KVLayout, num_blocks: int, info: PeerInfo) -> None:
    """The child's loop: builds the decode side, then answers the parent's calls in order."""
    from pdserve.kvtransfer.ucx_worker import UcxWorker

    ucx = side = None
    try:
        ucx = UcxWorker() if transport == "ucx" else None
        side = DecodeSide(transport, layout, num_blocks, info, ucx)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        pipe.send((False, f"{type(e).__name__}: {e}"))
        if ucx is not None:
            ucx.close()
        return
    pipe.send((True, side.address))
    waiters: dict[int, Waiter] = {}
    while True:
        command, *args = pipe.recv()
        try:
            if command == "close":
                side.close()
                if ucx is not None:
                    ucx.close()
                pipe.send((True, None))
                return
            if command == "zero":
                value = side.zero()
            elif command == "grant":
                value, waiters[value] = side.grant(*args)
            elif command == "wait":
                value = waiters.pop(args[0]).wait(args[1])
            elif command == "checksums":
                value = side.checksums(*args)
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as e:  # noqa: BLE001 - the parent reports it
            pipe.send((False, f"{type(e).__name__}: {e}"))
        else:
            pipe.send((True, value))


def decode_side(transport: str, layout: KVLayout, num_blocks: int, info: PeerInfo, ucx, in_process: bool):
    """The decode side of a link: in a child process (how pdserve runs), or in this one."""
    if in_process:
        return DecodeSide(transport, layout, num_blocks, info, ucx)
    return RemoteDecodeSide(transport, layout, num_blocks, info)


def connect(address: str, info: PeerInfo, cache: KVCacheView, transport: str, ucx) -> KVConnection:
    conn = KVConnection(address, info, cache, ucx=ucx if transport == "ucx" else None)
    if conn.name != transport:
        conn.close()
        raise RuntimeError(f"asked for {transport}, the handshake picked {conn.name}")
    return conn


class TransportLink:
    """A prefill-side connection to a decode side, moving whole transfers of one payload."""

    def __init__(
        self,
        transport: str,
        layout: KVLayout,
        src: KVCacheView,
        src_blocks: list[int],
        dst_blocks: list[int],
        num_tokens: int,
        src_sums: list[int],
        decode_info: PeerInfo,
        prefill_info: PeerInfo,
        ucx_pair,
        in_process: bool = False,
    ) -> None:
        self.name = transport
        self.layout, self.src, self.src_blocks = layout, src, src_blocks
        self.dst_blocks, self.num_tokens, self.src_sums = dst_blocks, num_tokens, src_sums
        ucx_decode, ucx_prefill = ucx_pair if transport == "ucx" else (None, None)
        self.decode = decode_side(transport, layout, len(dst_blocks), decode_info, ucx_decode, in_process)
        try:
            self.conn = connect(self.decode.address, prefill_info, src, transport, ucx_prefill)
        except BaseException:
            self.decode.close()
            raise

    def sample(self) -> float:
        self.decode.zero()
        transfer_id, landed = self.decode.grant(self.dst_blocks, self.num_tokens)
        acked = Waiter()
        started = time.perf_counter()
        transfer = self.conn.open(transfer_id, self.dst_blocks, self.layout.block_size, self.num_tokens)
        for layer in range(self.layout.num_layers):
            transfer.send_layer(layer, self.src_blocks, 0, self.num_tokens)
        transfer.finish(0, acked)
        acked.wait(self.name)
        elapsed = time.perf_counter() - started
        result = landed.wait(self.name)
        if result.nbytes != self.num_tokens * self.layout.num_layers * self.layout.token_bytes:
            raise RuntimeError(f"{self.name}: {result.nbytes} bytes landed")
        if self.decode.checksums(self.dst_blocks, self.num_tokens) != self.src_sums:
            raise RuntimeError(f"{self.name}: the bytes that landed differ from the source")
        return elapsed

    def close(self) -> None:
        self.conn.close()
        self.decode.close()


class MemcpyLink:
    name = "memcpy"

    def __init__(self, src: np.ndarray, dst: np.ndarray, src_sum: int) -> None:
        self.src, self.dst, self.src_sum = src, dst, src_sum

    def sample(self) -> float:
        self.dst.fill(0)
        started = time.perf_counter()
        np.copyto(self.dst, self.src)
        elapsed = time.perf_counter() - started
        if checksum(self.dst) != self.src_sum:
            raise RuntimeError("memcpy: copy differs")
        return elapsed

    def close(self) -> None:
        pass


class RawSocketLink:
    """A blocking TCP pair over loopback: sendall one buffer, recv_into another, 1-byte ack."""

    name = "raw_socket"

    def __init__(self, src: np.ndarray, dst: np.ndarray, src_sum: int) -> None:
        self.src, self.dst, self.src_sum = src, dst, src_sum
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(IO_TIMEOUT_S)
        self.send_sock = socket.create_connection(listener.getsockname(), timeout=IO_TIMEOUT_S)
        self.recv_sock, _ = listener.accept()
        listener.close()
        for s in (self.send_sock, self.recv_sock):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.recv_sock.settimeout(None)  # waits between samples; close() wakes it
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="raw-recv", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        view = memoryview(self.dst)
        try:
            while True:
                got = 0
                while got < len(view):
                    n = self.recv_sock.recv_into(view[got:])
                    if n == 0:
                        return
                    got += n
                self.recv_sock.sendall(b"k")
        except OSError as e:
            self.failure = e

    def sample(self) -> float:
        self.dst.fill(0)
        started = time.perf_counter()
        self.send_sock.sendall(self.src)
        if self.send_sock.recv(1) != b"k":
            raise RuntimeError(f"raw socket: no ack ({self.failure})")
        elapsed = time.perf_counter() - started
        if checksum(self.dst) != self.src_sum:
            raise RuntimeError("raw socket: bytes differ")
        return elapsed

    def close(self) -> None:
        for s in (self.send_sock, self.recv_sock):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._thread.join(5)


class RawUcxLink:
    """The whole payload as one UCX tagged message between two workers (what UCX alone does)."""

    name = "raw_ucx"

    def __init__(self, src: np.ndarray, dst: np.ndarray, src_sum: int, ucx_pair) -> None:
        self.src, self.dst, self.src_sum = src, dst, src_sum
        self.receiver, self.sender = ucx_pair
        self.sender.connect(self.receiver.address).result(timeout=IO_TIMEOUT_S)
        self.tag = 1 << 60

    def sample(self) -> float:
        self.dst.fill(0)
        self.tag += 1
        received, sent, errors = threading.Event(), threading.Event(), []

        def done(event: threading.Event):
            return lambda error: (errors.append(error) if error else None, event.set())

        started = time.perf_counter()
        self.receiver.recv(self.dst, self.tag, done(received))
        self.sender.send(self.receiver.address, self.src, self.tag, done(sent))
        if not (received.wait(IO_TIMEOUT_S) and sent.wait(IO_TIMEOUT_S)) or errors:
            raise RuntimeError(f"raw UCX: {errors or 'timed out'}")
        elapsed = time.perf_counter() - started
        if checksum(self.dst) != self.src_sum:
            raise RuntimeError("raw UCX: bytes differ")
        return elapsed

    def close(self) -> None:
        pass
