"""Rank 0 tells the other ranks what to run: each step's batch, packed into two int64 tensors.

A message is a fixed-size header (what to do, and the sizes of everything) followed by one flat
payload: the token ids, positions and KV slots, the decode block tables and context lengths,
each prefill segment's offsets and block table, and the rows that need logits. Both are
broadcast on the control group (gloo, CPU memory), whatever the device: two small messages
per step instead of a pickled object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment

HEADER_LEN = 8
# Every ForwardBatch field the channel carries (a test checks this against the dataclass, so a new
# field cannot be dropped silently between ranks).
CARRIED_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "num_decode",
    "decode_block_tables",
    "decode_context_lens",
    "prefills",
    "logits_indices",
)


class Op(enum.IntEnum):
    STEP = 1  # run the batch
    STEP_SAVING = 2  # run the batch; report each layer as its K/V is written (a prefill worker ships it)
    STATS = 3  # send your communication counters to rank 0
    STOP = 4  # leave the loop


@dataclass(frozen=True, slots=True)
class Message:
    op: Op
    batch: ForwardBatch | None = None
    num_micro_batches: int = 1


def pack(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """(sizes for the header, payload)."""
    nd, tables = batch.num_decode, batch.decode_block_tables
    width = tables.shape[1] if tables is not None else 0
    segs = batch.prefills
    seg_meta = [v for s in segs for v in (s.query_start, s.num_query, s.context_len, s.block_table.numel())]
    parts = [batch.input_ids, batch.positions, batch.slot_mapping]
    if nd:
        parts += [tables.reshape(-1), batch.decode_context_lens]
    parts += [torch.tensor(seg_meta, dtype=torch.int64)] + [s.block_table for s in segs] + [batch.logits_indices]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    return [batch.num_tokens, nd, width, len(segs), batch.logits_indices.numel(), payload.numel()], payload


def unpack(sizes: list[int], payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    tokens, nd, width, num_segs, num_logits, _ = sizes
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n : at]

    input_ids, positions, slots = take(tokens), take(tokens), take(tokens)
    tables = lens = None
    if nd:
        tables, lens = take(nd * width).view(nd, width), take(nd)
    meta = take(4 * num_segs).view(num_segs, 4).tolist()
    segments = [PrefillSegment(qs, nq, ctx, take(n).to(device)) for qs, nq, ctx, n in meta]
    logits = take(num_logits)
    on = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return ForwardBatch(on(input_ids), on(positions), on(slots), nd, on(tables), on(lens), segments, on(logits))


class StepChannel:
    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device

    def send(self, message: Message) -> None:
        """Rank 0: broadcasts ``message``."""
        sizes, payload = pack(message.batch) if message.batch is not None else ([0] * 6, None)
        header = torch.tensor([int(message.op), message.num_micro_batches, *sizes], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.group)

    def receive(self) -> Message:
        """Every other rank: waits for rank 0's next message."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, num_micro, *sizes = header.tolist()
        if op not in (Op.STEP, Op.STEP_SAVING):
            return Message(Op(op))
        payload = torch.empty(sizes[-1], dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        return Message(Op(op), unpack(sizes, payload, self.device), num_micro)
