"""The engine's half of the KV handoff (the scheduler side of vLLM v1's KV connector).

Prefill side: a request with ``kv_send`` ships each layer's K/V as soon as the forward pass
has written it (``save_hook``); once its first token is sampled it leaves the batch but keeps
its blocks (SENDING_KV) until the decode side acknowledges them, or until the acknowledgement
is overdue. Decode side: the scheduler admits a request with ``kv_receive`` by reserving its
blocks (WAITING_FOR_REMOTE_KV); the connector opens a grant for them with the worker-side
receiver and, once they are filled, joins the request to the running batch.

The worker-side halves (``OutgoingKV``, ``IncomingKV``, implemented by kvtransfer) move bytes
on their own threads and report each transfer's outcome exactly once into an inbox that the
engine drains at the start of every step; that inbox is the only engine state shared across
threads. An acknowledged prefill's last output also goes straight to its caller
(``deliver_early``), built from values copied on the engine thread.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request_output import KVReservation, KVSent, RequestOutput, TransferFailed
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How a transfer ended. For a receive, ``ok`` or not, it also means: nothing will write
    into its blocks any more."""

    ok: bool
    reason: str = ""
    corrupted: bool = False  # the K/V arrived damaged (checksum mismatch)
    first_token_id: int = -1  # receive side: the token the prefill worker sampled
    transport: str = ""
    nbytes: int = 0
    more_first_token_ids: tuple[int, ...] = ()  # receive side, n > 1: the other choices' first tokens


Report = Callable[[TransferOutcome], None]
LayerHook = Callable[[int], None]  # what the model calls after layer i has written its K/V


class OutgoingKV(Protocol):
    """The worker half of one request's send (prefill side)."""

    def send_layer(self, layer: int, block_ids: list[int], start: int, end: int) -> None:
        """Queues tokens [start, end) of ``layer`` (called on the engine thread, mid-forward)."""

    def finish(self, first_token_id: int, report: Report, more_token_ids: tuple[int, ...] = ()) -> None:
        """Queues the end of the transfer; ``report`` gets the decode side's answer, once.
        ``more_token_ids``: the other choices' first tokens (n > 1), carried with it."""

    def cancel(self) -> None:
        """Stops sending (the request is gone); nothing is reported after this."""


class IncomingKV(Protocol):
    """The worker half of receives (decode side): grants that prefill workers fill."""

    def grant(self, block_ids: list[int], num_tokens: int, skip_tokens: int, report: Report) -> int:
        """Accepts tokens [skip_tokens, num_tokens) of every layer into ``block_ids``; returns the
        transfer id. ``report`` is called once, when nothing more will land in the blocks."""

    def cancel(self, transfer_id: int, reason: str) -> None:
        """Ends a grant early; its ``report`` still comes, once its blocks are safe to reuse."""


@dataclass(slots=True)
class KVSend:
    transfer: OutgoingKV
    ack_timeout_s: float = 30.0  # the decode side's lease: past it, our copy is of no use


@dataclass(slots=True)
class KVReceive:
    receiver: IncomingKV
    transfer_id: int = -1  # set once the grant is open


class KVConnector:
    def __init__(
        self,
        scheduler: Scheduler,
        blocks: BlockManager,
        num_layers: int,
        vocab_size: int,
        finish_reason: Callable[[Sequence, int], FinishReason | None],
    ) -> None:
        self.scheduler = scheduler
        self.blocks = blocks
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.finish_reason = finish_reason
        self.pipelined = True  # False: send every layer after the prefill (a baseline to compare with)
        self.wake: Callable[[], None] = lambda: None  # set by the engine's thread: an outcome is waiting
        # Set by the engine loop (any thread may call it): a prefill's acknowledged handoff goes to
        # its caller at once. The inbox still frees its blocks at the next step, but a prefill step
        # can take a second, and the request's first token would wait for it.
        self.deliver_early: Callable[[RequestOutput], None] | None = None
        # Set by the engine (n > 1): forks a landed request into its choices, given every
        # choice's first token; returns the request's last output if no choice goes on.
        self.start_choices: Callable[[Sequence, list[int]], RequestOutput | None] | None = None
        self.sending: dict[Sequence, float] = {}  # prefilled here, waiting for the ack -> its deadline
        self._releasing: set[Sequence] = set()  # aborted while blocks were being written by a peer
        self._inbox: queue.SimpleQueue[tuple[Sequence, TransferOutcome]] = queue.SimpleQueue()

    # -- reports from transport threads (any thread) --------------------------------------------
    def _reporter(self, seq: Sequence) -> Report:
        def report(outcome: TransferOutcome) -> None:
            self._inbox.put((seq, outcome))
            self.wake()

        return report

    def _ack_reporter(self, seq: Sequence) -> Report:
        """The prefill side's report: the inbox, and an acknowledged handoff's output at once."""
        report, deliver = self._reporter(seq), self.deliver_early
        if deliver is None:
            return report
        request_id, prompt_tokens, cached_tokens = seq.request_id, seq.num_prompt_tokens, seq.num_cached_tokens

        def ack(outcome: TransferOutcome) -> None:
            report(outcome)  # first: the blocks are freed whatever happens to the early copy
            if outcome.ok:
                try:
                    deliver(_sent(request_id, prompt_tokens, cached_tokens, outcome))
                except RuntimeError:  # the event loop is closed (shutting down): nobody waits
                    pass

        return ack

    # -- decode side ------------------------------------------------------------------------------
    def open_grant(self, seq: Sequence) -> RequestOutput:
        """The scheduler reserved ``seq``'s blocks: let a prefill worker fill them."""
        receive = seq.kv_receive
        receive.transfer_id = receive.receiver.grant(
            list(seq.block_table), seq.num_tokens, seq.num_cached_tokens, self._reporter(seq)
        )
        reservation = KVReservation(receive.transfer_id, list(seq.block_table), seq.num_tokens, seq.num_cached_tokens)
        return RequestOutput(seq.request_id, [], None, seq.num_prompt_tokens, seq.num_cached_tokens, kv=reservation)

    def _landed(self, seq: Sequence, outcome: TransferOutcome) -> RequestOutput | None:
        bad = next(
            (t for t in (outcome.first_token_id, *outcome.more_first_token_ids) if not 0 <= t < self.vocab_size), None
        )
        if outcome.ok and bad is not None:
            outcome = TransferOutcome(False, f"the prefill worker sent token id {bad}, outside the vocabulary")
        if outcome.ok and len(outcome.more_first_token_ids) != seq.sampling.n - 1:
            outcome = TransferOutcome(
                False,
                f"the prefill worker sent {1 + len(outcome.more_first_token_ids)} first "
                f"tokens for {seq.sampling.n} choices",
            )
        if not outcome.ok:
            self.scheduler.remove(seq)
            self._finish(seq, free=True)
            return RequestOutput.failed(
                seq.request_id, TransferFailed(outcome.reason, outcome.corrupted), seq.num_prompt_tokens
            )
        seq.token_ids.append(outcome.first_token_id)
        seq.num_computed_tokens = seq.num_tokens - 1
        self.blocks.commit_full_blocks(seq)
        if seq.sampling.n > 1:  # every choice's first token came with the K/V: fork here
            self.scheduler.admit_landed(seq)
            return self.start_choices(seq, [outcome.first_token_id, *outcome.more_first_token_ids])
        reason = self.finish_reason(seq, outcome.first_token_id)
        if reason is not None:  # the prefill worker's token already ends it
            self.scheduler.remove(seq)
            self._finish(seq, free=True, reason=reason)
            return RequestOutput(
                seq.request_id, [], reason, seq.num_prompt_tokens, seq.num_cached_tokens, finished=True
            )
        self.scheduler.admit_landed(seq)
        return None

    # -- prefill side -----------------------------------------------------------------------------
    def save_hook(self, schedule: SchedulerOutput) -> LayerHook | None:
        """Run after each layer of this step's forward: queue that layer's new K/V for sending."""
        if not self.pipelined:
            return None
        units = []
        # Decodes too: a prompt whose chunks left one token runs that token as a decode chunk
        # (``is_prefilling`` ends a token early), and its K/V belong to the prompt.
        for chunk in (*schedule.prefills, *schedule.decodes):
            seq = chunk.seq
            if seq.kv_send is None:
                continue
            # The first chunk also carries the prefix that came from the prefix cache.
            start = 0 if chunk.start == seq.num_cached_tokens else chunk.start
            end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens)
            units.append((seq.kv_send.transfer, list(seq.block_table), start, end))
        if not units:
            return None

        def save_layer(layer: int) -> None:
            for transfer, block_ids, start, end in units:
                transfer.send_layer(layer, block_ids, start, end)

        return save_layer

    def prompt_done(self, seq: Sequence, more_first_token_ids: tuple[int, ...] = ()) -> None:
        """``seq``'s first token is sampled and does not end it: hold its blocks until the ack.
        ``more_first_token_ids``: the other choices' first tokens (n > 1), sent with it."""
        transfer = seq.kv_send.transfer
        if not self.pipelined:
            for layer in range(self.num_layers):
                transfer.send_layer(layer, list(seq.block_table), 0, seq.num_prompt_tokens)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.SENDING_KV
        self.sending[seq] = time.monotonic() + seq.kv_send.ack_timeout_s
        if more_first_token_ids:
            transfer.finish(seq.last_token_id, self._ack_reporter(seq), tuple(more_first_token_ids))
        else:  # n = 1: the two-argument form every OutgoingKV has
            transfer.finish(seq.last_token_id, self._ack_reporter(seq))

    def _acked(self, seq: Sequence, outcome: TransferOutcome) -> RequestOutput:
        del self.sending[seq]
        self._finish(seq, free=True)
        if not outcome.ok:
            return RequestOutput.failed(
                seq.request_id, TransferFailed(outcome.reason, outcome.corrupted), seq.num_prompt_tokens
            )
        return _sent(seq.request_id, seq.num_prompt_tokens, seq.num_cached_tokens, outcome)

    # -- once per step (engine thread) -----------------------------------------------------------------
    def drain(self) -> list[RequestOutput]:
        """Applies every outcome reported since the last step and expires overdue acks."""
        outputs = []
        while True:
            try:
                seq, outcome = self._inbox.get_nowait()
            except queue.Empty:
                break
            out = None
            if seq in self._releasing:  # aborted earlier: the blocks are ours again
                self._releasing.discard(seq)
                self.blocks.free(seq)
            elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
                out = self._landed(seq, outcome)
            elif seq.status is SequenceStatus.SENDING_KV:
                out = self._acked(seq, outcome)
            if out is not None:
                outputs.append(out)
        now = time.monotonic()
        for seq in [s for s, deadline in self.sending.items() if deadline < now]:
            seq.kv_send.transfer.cancel()
            error = TransferFailed("the decode worker did not acknowledge the KV transfer in time")
            del self.sending[seq]
            self._finish(seq, free=True)
            outputs.append(RequestOutput.failed(seq.request_id, error, seq.num_prompt_tokens))
        return outputs

    def next_deadline(self) -> float | None:
        return min(self.sending.values(), default=None)

    def abort(self, seq: Sequence) -> bool:
        """Drops a request in a handoff state; False if it is in none (the caller frees it)."""
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.remove(seq)
            seq.status = SequenceStatus.FINISHED
            self._releasing.add(seq)  # freed when the receiver reports nothing more can land
            seq.kv_receive.receiver.cancel(seq.kv_receive.transfer_id, "request ended before its KV cache arrived")
            return True
        if seq.status is SequenceStatus.SENDING_KV:
            del self.sending[seq]
            seq.kv_send.transfer.cancel()
            self._finish(seq, free=True)
            return True
        if seq.kv_send is not None:
            seq.kv_send.transfer.cancel()
        return False

    @property
    def num_releasing(self) -> int:
        return len(self._releasing)

    def _finish(self, seq: Sequence, free: bool, reason: FinishReason | None = None) -> None:
        if free:
            self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


def _sent(request_id: str, prompt_tokens: int, cached_tokens: int, outcome: TransferOutcome) -> RequestOutput:
    """A prefill's last output: its handoff was acknowledged."""
    return RequestOutput(
        request_id, [], None, prompt_tokens, cached_tokens, finished=True, kv=KVSent(outcome.transport, outcome.nbytes)
    )
