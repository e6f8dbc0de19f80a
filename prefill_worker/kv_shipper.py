"""Ships each prefill's K/V layer by layer while the forward pass is still running.

The engine calls ``on_forward`` with every step's schedule; for the chunks that belong to a
request with a transfer target, the returned hook queues that layer's K/V on the transfer
connection as soon as the layer has written it. The connection's own thread does the I/O,
so sending layer i overlaps computing layer i+1.
"""

from __future__ import annotations

from pdserve.engine.model import LayerHook
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvtransfer.client import Outgoing


class KVShipper:
    def __init__(self) -> None:
        self.transfers: dict[str, Outgoing] = {}  # request id -> where its K/V goes
        self.pipelined = True  # False: ship after the whole prefill (for comparison)

    def on_forward(self, schedule: SchedulerOutput) -> LayerHook | None:
        if not self.pipelined:
            return None
        units = []
        for chunk in schedule.prefills:
            seq = chunk.seq
            out = self.transfers.get(seq.request_id)
            if out is None:
                continue
            # The first chunk also carries the prefix that came from the prefix cache.
            start = 0 if chunk.start == seq.num_cached_tokens else chunk.start
            units.append((out, list(seq.block_table), start, chunk.start + chunk.num_tokens))
        if not units:
            return None

        def ship(layer: int) -> None:
            for out, blocks, start, end in units:
                out.send_layer(layer, blocks, start, end)

        return ship
