"""The engine's half of the KV handoff (no model, no sockets): fake worker halves stand in for
kvtransfer and report outcomes from another thread, as the real ones do."""

from __future__ import annotations

import threading
import time

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_connector import KVConnector, KVReceive, KVSend, TransferOutcome
from pdserve.engine.request_output import KVSent, TransferFailed
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus

BS, LAYERS, EOS, VOCAB = 4, 3, 0, 100


class FakeReceiver:
    """Records grants; ``cancel`` reports like the real ledger does (once, when safe)."""

    def __init__(self) -> None:
        self.grants: dict[int, tuple] = {}
        self.cancelled: list[int] = []

    def grant(self, block_ids, num_tokens, skip_tokens, report) -> int:
        transfer_id = len(self.grants) + 1
        self.grants[transfer_id] = (block_ids, num_tokens, skip_tokens, report)
        return transfer_id

    def cancel(self, transfer_id: int, reason: str) -> None:
        self.cancelled.append(transfer_id)

    def report_from_thread(self, transfer_id: int, outcome: TransferOutcome) -> None:
        t = threading.Thread(target=self.grants[transfer_id][3], args=(outcome,))
        t.start()
        t.join()


class FakeTransfer:
    def __init__(self) -> None:
        self.layers: list[tuple[int, list[int], int, int]] = []
        self.finished_with: int | None = None
        self.report = None
        self.cancelled = False

    def send_layer(self, layer, block_ids, start, end) -> None:
        self.layers.append((layer, block_ids, start, end))

    def finish(self, first_token_id, report) -> None:
        self.finished_with, self.report = first_token_id, report

    def cancel(self) -> None:
        self.cancelled = True


class Harness:
    """A scheduler, a block manager and the connector, wired as ``LLMEngine`` wires them."""

    def __init__(self, num_blocks: int = 16, budget: int = 64) -> None:
        self.blocks = BlockManager(num_blocks, BS)
        self.scheduler = Scheduler(SchedulerConfig(8, budget), self.blocks)
        self.connector = KVConnector(self.scheduler, self.blocks, LAYERS, VOCAB, self.finish_reason)
        self.woken = threading.Event()
        self.connector.wake = self.woken.set

    @staticmethod
    def finish_reason(seq: Sequence, token: int) -> FinishReason | None:
        return FinishReason.STOP if token == EOS else None

    def add(self, rid: str, n: int, **kv) -> Sequence:
        seq = Sequence(rid, list(range(10, 10 + n)), n, SamplingParams(max_tokens=8), **kv)
        self.scheduler.add(seq)
        return seq

    def step(self, first_token: int = 5) -> list:
        """A step as the engine runs it, with a forward that computes whatever is scheduled."""
        outputs = self.connector.drain()
        schedule = self.scheduler.schedule()
        outputs += [self.connector.open_grant(s) for s in schedule.reserved]
        hook = self.connector.save_hook(schedule)
        if hook:
            for layer in range(LAYERS):
                hook(layer)
        for chunk in schedule.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.completes:
                seq.token_ids.append(first_token)
                if seq.kv_send is not None:
                    self.connector.prompt_done(seq)
        return outputs


def test_decode_side_reserves_grants_and_joins_the_batch_once_the_kv_has_landed():
    h, receiver = Harness(), FakeReceiver()
    seq = h.add("r", 9, kv_receive=KVReceive(receiver))
    [out] = h.step()
    assert out.kv.transfer_id == 1 and out.kv.block_ids == seq.block_table and len(seq.block_table) == 3
    assert out.kv.num_tokens == 9 and not out.finished
    assert receiver.grants[1][:3] == (seq.block_table, 9, 0)
    assert h.step() == [] and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV

    receiver.report_from_thread(1, TransferOutcome(ok=True, first_token_id=42, transport="tcp", nbytes=123))
    assert h.woken.is_set()
    h.connector.drain()
    assert seq.status is SequenceStatus.RUNNING and seq.token_ids[-1] == 42 and seq.num_computed_tokens == 9
    assert seq.block_hashes  # the landed prompt is in the prefix cache
    schedule = h.scheduler.schedule()
    assert [c.seq for c in schedule.decodes] == [seq]


def test_a_reservation_shares_the_cached_prefix_and_skips_it():
    h, receiver = Harness(), FakeReceiver()
    first = h.add("a", 8, kv_receive=KVReceive(receiver))
    h.step()
    receiver.report_from_thread(1, TransferOutcome(ok=True, first_token_id=5))
    h.connector.drain()
    second = h.add("b", 10, kv_receive=KVReceive(receiver))
    [out] = h.step()
    assert out.kv.num_cached_tokens == 8 and second.block_table[:2] == first.block_table[:2]
    assert receiver.grants[2][2] == 8


def test_a_first_token_that_ends_the_request_frees_its_blocks():
    h, receiver = Harness(), FakeReceiver()
    h.add("r", 5, kv_receive=KVReceive(receiver))
    h.step()
    receiver.report_from_thread(1, TransferOutcome(ok=True, first_token_id=EOS))
    [out] = h.connector.drain()
    assert out.finished and out.finish_reason is FinishReason.STOP and out.new_token_ids == []
    assert h.blocks.num_free == h.blocks.num_blocks and h.scheduler.num_unfinished == 0


def test_a_first_token_outside_the_vocabulary_fails_the_transfer():
    h, receiver = Harness(), FakeReceiver()
    h.add("r", 5, kv_receive=KVReceive(receiver))
    h.step()
    receiver.report_from_thread(1, TransferOutcome(ok=True, first_token_id=VOCAB))
    [out] = h.connector.drain()
    assert isinstance(out.error, TransferFailed) and "vocabulary" in str(out.error)
    assert h.blocks.num_free == h.blocks.num_blocks


def test_a_failed_transfer_ends_the_request_with_its_reason():
    h, receiver = Harness(), FakeReceiver()
    h.add("r", 5, kv_receive=KVReceive(receiver))
    h.step()
    receiver.report_from_thread(1, TransferOutcome(ok=False, reason="checksum mismatch", corrupted=True))
    [out] = h.connector.drain()
    assert out.finished and isinstance(out.error, TransferFailed) and out.error.corrupted
    assert h.blocks.num_free == h.blocks.num_blocks


def test_an_abort_while_waiting_keeps_the_blocks_until_nothing_more_can_land():
    h, receiver = Harness(), FakeReceiver()
    seq = h.add("r", 5, kv_receive=KVReceive(receiver))
    h.step()
    assert h.connector.abort(seq)
    assert receiver.cancelled == [1] and h.connector.num_releasing == 1
    assert h.blocks.num_free == h.blocks.num_blocks - 2  # a peer may still be writing into them
    receiver.report_from_thread(1, TransferOutcome(ok=False, reason="cancelled"))
    assert h.connector.drain() == []
    assert h.blocks.num_free == h.blocks.num_blocks and h.connector.num_releasing == 0


def test_prefill_side_saves_each_layer_and_holds_blocks_until_the_ack():
    h, transfer = Harness(budget=6), FakeTransfer()
    seq = h.add("p", 10, kv_send=KVSend(transfer, ack_timeout_s=30))
    h.step()  # chunk [0, 6)
    h.step()  # chunk [6, 10), first token
    assert transfer.layers == [(layer, seq.block_table, 0, 6) for layer in range(LAYERS)] + [
        (layer, seq.block_table, 6, 10) for layer in range(LAYERS)
    ]
    assert transfer.finished_with == 5 and seq.status is SequenceStatus.SENDING_KV
    assert h.scheduler.num_unfinished == 0 and h.blocks.num_free == h.blocks.num_blocks - 3

    transfer.report(TransferOutcome(ok=True, transport="shm", nbytes=99))
    [out] = h.connector.drain()
    assert out.finished and out.kv == KVSent("shm", 99) and out.error is None
    assert h.blocks.num_free == h.blocks.num_blocks and not h.connector.sending


def test_a_prompt_whose_chunks_leave_one_token_sends_that_token_too():
    """Budget + 1 tokens: the last prompt token runs as a decode chunk; its K/V still go."""
    h, transfer = Harness(budget=6), FakeTransfer()
    seq = h.add("p", 7, kv_send=KVSend(transfer, ack_timeout_s=30))
    h.step()  # chunk [0, 6)
    assert not seq.is_prefilling
    h.step()  # the decode chunk [6, 7), first token
    assert transfer.layers == [(layer, seq.block_table, 0, 6) for layer in range(LAYERS)] + [
        (layer, seq.block_table, 6, 7) for layer in range(LAYERS)
    ]
    assert transfer.finished_with == 5 and seq.status is SequenceStatus.SENDING_KV


def test_a_prompt_handing_off_its_kv_is_not_preempted_part_way():
    """A decode that needs a block takes it from a request that can start again, itself if need
    be, never from a prompt whose layers are already on their way: re-run, it would send
    over what the receiver holds (and its queued units would read freed blocks)."""
    h, transfer = Harness(num_blocks=4, budget=4), FakeTransfer()
    d = h.add("d", 3)
    h.step()  # d: [0, 3) and its first token; one block
    p = h.add("p", 12, kv_send=KVSend(transfer, ack_timeout_s=30))
    h.step()  # d decodes; p takes the 3 other blocks and sends [0, 3)
    h.step()  # d needs a second block: none is free
    assert d.status is SequenceStatus.WAITING and p.status is SequenceStatus.RUNNING
    while transfer.finished_with is None:
        h.step()
    sent = [(start, end) for layer, _, start, end in transfer.layers if layer == 0]
    assert sent == [(0, 3), (3, 7), (7, 11), (11, 12)]  # each prompt token once


def test_the_first_chunk_carries_the_cached_prefix():
    h, transfer = Harness(), FakeTransfer()
    warm = h.add("warm", 9)
    h.step()
    h.scheduler.remove(warm)
    h.blocks.free(warm)
    h.add("p", 9, kv_send=KVSend(transfer))
    h.step()
    assert transfer.layers[0][2:] == (0, 9)  # tokens [0, 8) came from the cache, still sent


def test_send_after_prefill_sends_every_layer_at_the_end():
    h, transfer = Harness(budget=6), FakeTransfer()
    h.connector.pipelined = False
    h.add("p", 10, kv_send=KVSend(transfer))
    h.step()
    assert transfer.layers == []
    h.step()
    assert [(layer, start, end) for layer, _, start, end in transfer.layers] == [
        (layer, 0, 10) for layer in range(LAYERS)
    ]


def test_an_overdue_ack_cancels_the_transfer_and_frees_the_blocks():
    h, transfer = Harness(), FakeTransfer()
    h.add("p", 5, kv_send=KVSend(transfer, ack_timeout_s=0.05))
    h.step()
    assert h.connector.next_deadline() is not None
    time.sleep(0.06)
    [out] = h.connector.drain()
    assert isinstance(out.error, TransferFailed) and transfer.cancelled
    assert h.blocks.num_free == h.blocks.num_blocks
    transfer.report(TransferOutcome(ok=True))  # a late ack changes nothing
    assert h.connector.drain() == []


def test_an_abort_while_sending_cancels_and_frees_at_once():
    h, transfer = Harness(), FakeTransfer()
    seq = h.add("p", 5, kv_send=KVSend(transfer))
    h.step()
    assert h.connector.abort(seq) and transfer.cancelled
    assert h.blocks.num_free == h.blocks.num_blocks and not h.connector.sending
