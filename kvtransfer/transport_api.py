"""What a transport module implements, and what it is given.

A transport (one module, listed in ``registry``) provides:

* ``unavailable_reason(device) -> str | None``: why it cannot run in this process, or None.
* ``class Sender(ctx: SendContext)``: ``send(unit)`` moves one unit (on the connection's
  sender thread, in order) and announces it on the control channel; ``flush(transfer_id)``
  returns once every unit of the transfer has left (or raises); ``close()``;
  ``max_span_bytes``: how large a unit of several consecutive layers ``send`` takes (the
  connection joins layers queued together up to that size; 0: one layer per unit).
* ``class Receiver(ctx: ReceiveContext)``: ``handlers`` maps the frame kinds it owns to
  functions of the frame header (run on the connection's thread); ``hello_extra()`` is what
  the peer needs to use it (merged into HELLO_OK); ``close()``; optionally ``check()``, run
  after every frame and whenever the connection is idle: it raises to drop the connection.
* optionally ``make_pool(layout, num_blocks, device)``: the decode worker's KV cache storage,
  an object with ``tensor``, ``describe() -> dict`` (for the handshake) and ``close()``; it
  raises ``PoolUnavailable`` (why) when it cannot hold the cache, and the worker then keeps
  the cache in its own memory and stops offering the transport;
  and ``usable_with(decode_extra, prefill_extra) -> bool`` for a pairing check beyond
  "same host" (CUDA IPC: the decode GPU is visible to the prefill worker).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.layout import KVCacheView, Slots
from pdserve.kvtransfer.protocol import MAX_SPAN_BYTES, FrameHeader
from pdserve.kvtransfer.sockets import send_buffers

IO_TIMEOUT_S = 10.0  # once a unit has started, the rest of it must arrive within this
MAX_DEFERRED_FRAMES = 4


class PoolUnavailable(Exception):
    """A transport's ``make_pool`` cannot hold the KV cache here (the message says why)."""


@dataclass(frozen=True, slots=True)
class Unit:
    """Tokens [start, end) of layers [layer, layer + num_layers) of one transfer, as the
    sender thread sends them."""

    transfer_id: int
    layer: int
    start: int
    end: int
    src: Slots  # where they are in each layer of our cache
    dst: Slots | None  # where they go in each layer of the receiver's cache (one-sided transports only)
    ready: object = None  # a CUDA event the K/V are written by (GPU caches)
    num_layers: int = 1

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def follows(self, other: "Unit") -> bool:
        """This unit is the layer right after ``other``'s, for the same tokens and slots (they can travel as one)."""
        return (
            self.transfer_id == other.transfer_id
            and self.layer == other.layer + other.num_layers
            and (self.start, self.end) == (other.start, other.end)
            and self.src is other.src
            and self.dst is other.dst
            and self.ready is None
            and other.ready is None
        )


@dataclass
class SendContext:
    sock: socket.socket  # the control channel (also the data channel for TCP)
    cache: KVCacheView
    remote_extra: dict  # the decode side's transport parameters, from HELLO_OK
    faults: FaultPlan
    ucx: object = None  # the process's UcxWorker, when UCX is offered
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    deferred: list[bytes] = field(default_factory=list)

    def send_frame(self, header: FrameHeader, *payload, defer: bool = False) -> None:
        """Sends a frame, after any deferred ones. ``defer``: a header-only frame that may wait
        for a few more (the connection also flushes whenever it runs out of work), so a burst
        of small units costs a system call per few units, and the receiver still verifies
        while the sender copies."""
        with self.send_lock:
            if defer and len(self.deferred) < MAX_DEFERRED_FRAMES - 1:
                self.deferred.append(header.pack())
                return
            buffers, self.deferred = [*self.deferred, header.pack(), *payload], []
            send_buffers(self.sock, buffers)

    def flush(self) -> None:
        with self.send_lock:
            if self.deferred:
                buffers, self.deferred = self.deferred, []
                send_buffers(self.sock, buffers)


@dataclass
class ReceiveContext:
    sock: socket.socket
    cache: KVCacheView
    ledger: GrantLedger
    ucx: object = None
    peer: str = ""
    local_extra: dict = field(default_factory=dict)  # what this decode worker announced (its pool, ...)

    def max_unit_bytes(self, num_layers: int) -> int:
        """The most bytes a unit of ``num_layers`` layers may carry here (a larger one breaks the protocol)."""
        layer_bytes = self.cache.slots_per_layer * self.cache.token_bytes
        return layer_bytes if num_layers == 1 else min(MAX_SPAN_BYTES, layer_bytes * self.cache.num_layers)
