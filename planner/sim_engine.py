"""The engine of a simulated worker: pdserve's own scheduler, block manager and KV connector,
with the forward pass replaced by its cost from a profile and the KV transfers by events.

The bookkeeping follows ``LLMEngine.step``, split at the forward pass so that simulated time
passes in between. ``begin_step`` applies the transfer outcomes reported since the last step
(the connector's inbox: acknowledged sends free their blocks, landed receives join the running
batch), runs the real ``Scheduler.schedule`` (chunked prefill, token budget, admission by free
blocks, prefix cache hits, preemption, block reservations for remote KV) and opens the grants
of new reservations. ``finish_step`` advances every scheduled sequence as ``LLMEngine._forward``
does after the model ran: a token is sampled where a chunk reached the end, full blocks enter
the prefix cache, a sequence finishes at its length (outputs ignore EOS, as the benchmark's
requests do), and a prefill whose K/V go to a decode worker holds its blocks until the decode
side acknowledges them (``KVConnector.prompt_done``).

The worker halves of the handoff are the simulator's: ``SimTransfer.finish`` hands the send to
it, and it reports both sides' outcomes when the modelled transfer is over. Time is the one
thing the engine's code cannot take from the simulation: the scheduler's start deadlines and
the connector's acknowledgement deadline run on the wall clock, so simulated requests carry
neither and the simulator keeps its own deadlines (``expire``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine_stats import collect_stats
from pdserve.engine.kv_connector import KVConnector, KVReceive, KVSend, Report, TransferOutcome
from pdserve.engine.request_output import RequestOutput, RequestRejected
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.planner.profile import StepShape
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.wire import worker_stats

SAMPLED_TOKEN = 1  # what a simulated forward "samples"; block hashes chain from the prompt, so outputs stay distinct
VOCAB_SIZE = 2**31  # the connector checks a received first token against the vocabulary; any id of a workload fits


@dataclass(frozen=True, slots=True)
class EngineLimits:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 8192


class SimReceiver:
    """A decode worker's half of receives (``IncomingKV``): grants that the simulator fills when
    the transfer it models is over."""

    def __init__(self) -> None:
        self._reports: dict[int, Report] = {}
        self._ids = itertools.count(1)

    def grant(self, block_ids: list[int], num_tokens: int, skip_tokens: int, report: Report) -> int:
        transfer_id = next(self._ids)
        self._reports[transfer_id] = report
        return transfer_id

    def cancel(self, transfer_id: int, reason: str) -> None:
        report = self._reports.pop(transfer_id, None)
        if report is not None:  # nothing is being written into the blocks: they are safe at once
            report(TransferOutcome(False, reason))

    def land(self, transfer_id: int, first_token_id: int, transport: str, nbytes: int) -> bool:
        """The K/V are in the blocks; False if the grant was cancelled meanwhile."""
        report = self._reports.pop(transfer_id, None)
        if report is not None:
            report(TransferOutcome(True, first_token_id=first_token_id, transport=transport, nbytes=nbytes))
        return report is not None

    @property
    def num_active(self) -> int:
        return len(self._reports)


class SimTransfer:
    """One request's send (``OutgoingKV``). Its cost is modelled as a whole, from the moment the
    first token is sampled (``finish``); the per-layer units are not simulated."""

    def __init__(self, on_finish: Callable[["SimTransfer", int], None]) -> None:
        self.on_finish = on_finish
        self.report: Report | None = None
        self.cancelled = False

    def send_layer(self, layer: int, block_ids: list[int], start: int, end: int) -> None:
        pass

    def finish(self, first_token_id: int, report: Report) -> None:
        self.report = report
        self.on_finish(self, first_token_id)

    def cancel(self) -> None:
        self.cancelled = True


class SimEngine:
    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.blocks = BlockManager(limits.num_blocks, limits.block_size, limits.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens, limits.enable_chunked_prefill),
            self.blocks,
        )
        self.connector = KVConnector(self.scheduler, self.blocks, 1, VOCAB_SIZE, self._finish_reason)
        self.receiver = SimReceiver()
        self.requests: dict[str, Sequence] = {}

    # -- requests (``LLMEngine.validate``, ``add_request``, ``abort``) ------------------------
    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits this worker at all."""
        return (
            num_tokens < self.limits.max_model_len
            and self.blocks.blocks_needed(num_tokens + 1) <= self.blocks.num_blocks
        )

    def add_request(
        self,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        now: float,
        *,
        kv_send: KVSend | None = None,
        kv_receive: KVReceive | None = None,
    ) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence(
            request_id,
            list(token_ids),
            len(token_ids),
            sampling,
            arrival_time=now,
            kv_send=kv_send,
            kv_receive=kv_receive,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if not self.connector.abort(seq):
            self.scheduler.remove(seq)
            self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        return True

    def expire(self, request_id: str) -> bool:
        """A request that has not been admitted when its wait runs out leaves the queue, rejected
        (what ``Scheduler`` does at a start deadline); False if it was admitted."""
        seq = self.requests.get(request_id)
        if seq is None or seq not in self.scheduler.waiting or seq.admitted_at >= 0:
            return False
        self.scheduler.remove(seq)
        self.scheduler.num_rejected += 1
        del self.requests[request_id]
        seq.status = SequenceStatus.FINISHED
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.connector.num_releasing > 0

    # -- the step ---------------------------------------------------------------------------------
    def begin_step(self) -> tuple[list[RequestOutput], SchedulerOutput]:
        """Everything ``LLMEngine.step`` does before the forward pass: the outputs it already
        has (reservations, acknowledged handoffs, failures) and what the forward runs."""
        outputs = self.connector.drain()
        schedule = self.scheduler.schedule()
        for seq in schedule.expired:
            seq.status = SequenceStatus.FINISHED
            outputs.append(
                RequestOutput.failed(seq.request_id, RequestRejected("could not start in time"), seq.num_prompt_tokens)
            )
        outputs += [self.connector.open_grant(seq) for seq in schedule.reserved]
        self._retire(outputs)
        return outputs, schedule

    @staticmethod
    def shape(schedule: SchedulerOutput) -> StepShape:
        return StepShape.of(
            [c.seq.num_tokens for c in schedule.decodes], [(c.start, c.num_tokens) for c in schedule.prefills]
        )

    def finish_step(self, schedule: SchedulerOutput) -> list[RequestOutput]:
        """Advances every scheduled sequence as ``LLMEngine._forward`` does after the model ran."""
        for chunk in schedule.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        outputs = []
        for chunk in schedule.chunks:
            if not chunk.completes:
                continue
            seq = chunk.seq
            seq.token_ids.append(SAMPLED_TOKEN)
            self.blocks.commit_full_blocks(seq)
            reason = self._finish_reason(seq, SAMPLED_TOKEN)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            elif seq.kv_send is not None:
                self.connector.prompt_done(seq)  # keeps its blocks until the decode side has the K/V
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    [SAMPLED_TOKEN],
                    reason,
                    seq.num_prompt_tokens,
                    seq.num_cached_tokens,
                    finished=reason is not None,
                )
            )
        for chunk in schedule.prefills:
            if not chunk.completes:
                self.blocks.commit_full_blocks(chunk.seq)
        self._retire(outputs)
        return outputs

    def _retire(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- what the router sees (``LLMEngine.stats`` through the workers' ``GetStats``) ----------------
    def stats(self, address: str, role: str, prefill_tokens_per_s: float) -> pb.WorkerStats:
        stats = collect_stats(
            self.scheduler,
            self.connector,
            cached_block_hashes=tuple(self.blocks.cached),
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        return worker_stats(
            stats, role, address, self.receiver.num_active, None, self.limits.block_size, self.limits.max_num_seqs
        )
