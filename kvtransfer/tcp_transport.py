"""TCP: the unit's bytes follow its DATA header on the control connection.

Sender: one ``sendmsg`` of header + bytes, read in place from the cache when the unit is one
contiguous range of one layer, else gathered into a staging buffer, hashed in the same pass. Receiver: one
``recv`` (MSG_WAITALL) of the whole payload, in place when the destination is contiguous,
else into a staging buffer scattered into the cache, the checksum taken in the pass that
scatters it. Works everywhere; a GPU cache goes through pinned host buffers.
"""

from __future__ import annotations

import numpy as np

from pdserve.kvtransfer.protocol import FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.sockets import discard, recv_exact
from pdserve.kvtransfer.transport_api import ReceiveContext, SendContext, Unit


def unavailable_reason(device) -> str | None:
    return None


class Sender:
    name = "tcp"

    def __init__(self, ctx: SendContext) -> None:
        self.ctx = ctx

    max_span_bytes = 1 << 20  # small layers join; larger ones pipeline (gather, socket, scatter) one by one

    def send(self, unit: Unit) -> None:
        data, digest = self.ctx.cache.read_hashed(unit.layer, unit.src, unit.ready, unit.num_layers)
        try:
            payload = data.data
            if self.ctx.faults.take("corrupt"):
                payload = flipped(payload)
            header = FrameHeader(
                FrameKind.DATA,
                unit.transfer_id,
                unit.layer,
                unit.start,
                unit.end,
                payload_len=payload.nbytes,
                checksum=digest,
                num_layers=unit.num_layers,
            )
            self.ctx.send_frame(header, payload)
        finally:
            data.release()

    def flush(self, transfer_id: int) -> None:
        pass  # sendmsg returned: the bytes are in the kernel, ahead of DONE

    def close(self) -> None:
        pass


class Receiver:
    def __init__(self, ctx: ReceiveContext) -> None:
        self.ctx = ctx
        self.scratch = bytearray(1 << 20)
        self.handlers = {FrameKind.DATA: self._data}

    def hello_extra(self) -> dict:
        return {}

    def _data(self, h: FrameHeader) -> None:
        limit = self.ctx.max_unit_bytes(h.num_layers)
        if h.payload_len > limit:
            raise ProtocolError(f"DATA frame of {h.payload_len} bytes for {h.num_layers} layers exceeds {limit}")
        ledger, cache = self.ctx.ledger, self.ctx.cache
        grant = ledger.admit(h.transfer_id, h.layer, h.start, h.end, h.payload_len, "DATA", h.num_layers)
        if grant is None:
            discard(self.ctx.sock, h.payload_len, self.scratch)
            return
        ok, target = None, None
        try:
            target = cache.write_target(h.layer, grant.slots(cache, h.start, h.end), h.num_layers)
            recv_exact(self.ctx.sock, target.data)
            ok = target.commit_hashed() == h.checksum
        finally:
            if target is not None:
                target.release()
            ledger.end_write(grant, h.layer, h.start, h.end, ok, num_layers=h.num_layers)

    def close(self) -> None:
        pass


def flipped(data: np.ndarray) -> np.ndarray:
    """A copy of ``data`` with one byte changed (fault injection: the receiver must notice)."""
    copy = np.array(data, dtype=np.uint8).reshape(-1)
    copy[len(copy) // 2] ^= 0x5A
    return copy
