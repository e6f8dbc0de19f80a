"""The engine of a simulated worker: pdserve's own scheduler and block manager, with the
forward pass replaced by its cost from a profile.

The bookkeeping follows ``LLMEngine``: a request waits in the scheduler's queue (or, after a
KV handoff, joins the running batch with the blocks it was given); each step runs the real
``Scheduler.schedule`` (chunked prefill, token budget, admission by free blocks, prefix cache
hits, preemption); afterwards every scheduled sequence advances as it does after a forward,
sampling a token where its chunk reached the end, registering full blocks in the prefix
cache, and finishing at its length (outputs ignore EOS, as the benchmark's requests do). A
prefill-only request keeps its blocks until it is released, as a prefill worker's does until
the KV transfer is acknowledged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.planner.profile import StepShape
from pdserve.v1 import pdserve_pb2 as pb

SAMPLED_TOKEN = 1  # what a simulated forward "samples"; block hashes chain from the prompt, so outputs stay distinct


@dataclass(frozen=True, slots=True)
class EngineLimits:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 8192


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: str
    first: bool  # the request's first generated token
    finished: bool  # its last token (length reached)
    prefilled: bool  # a prefill-only request is done: its KV is ready to ship


class SimEngine:
    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.blocks = BlockManager(limits.num_blocks, limits.block_size, limits.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens, limits.enable_chunked_prefill), self.blocks)
        self.requests: dict[str, Sequence] = {}
        self.prefilled: dict[str, Sequence] = {}

    # -- requests ----------------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits this worker at all (``LLMEngine.validate``)."""
        return num_tokens < self.limits.max_model_len and self.blocks.blocks_needed(num_tokens + 1) <= self.blocks.num_blocks

    def add_request(self, request_id: str, token_ids: list[int], max_tokens: int, now: float,
                    prefill_only: bool = False) -> None:
        seq = Sequence(request_id, list(token_ids), len(token_ids), _sampling(max_tokens), arrival_time=now,
                       prefill_only=prefill_only)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def reserve(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], int] | None:
        """Blocks for KV that will arrive from a prefill worker (``LLMEngine.reserve_blocks``);
        None while they do not fit."""
        try:
            return self.blocks.allocate_for_tokens(token_ids, num_tokens)
        except MemoryError:
            return None

    def add_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, max_tokens: int,
                      block_ids: list[int], num_cached_tokens: int, now: float) -> bool:
        """Starts decoding a request whose KV landed in ``block_ids`` (``LLMEngine.add_prefilled``);
        True if its first token already ended it."""
        seq = Sequence(request_id, list(token_ids), num_prompt_tokens, _sampling(max_tokens), arrival_time=now)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(token_ids) - 1
        seq.num_cached_tokens = num_cached_tokens
        seq.block_hashes = [self.blocks.blocks[b].hash for b in block_ids[: num_cached_tokens // self.limits.block_size]]
        if seq.num_output_tokens >= max_tokens or not self.blocks.ensure_capacity(seq, seq.num_tokens):
            self.blocks.free(seq)
            return True
        self.blocks.commit_full_blocks(seq)
        self.requests[request_id] = seq
        self.scheduler.add_running(seq)
        return False

    def release(self, request_id: str) -> None:
        seq = self.prefilled.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    # -- steps -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.scheduler.swapped)

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    @staticmethod
    def shape(schedule: SchedulerOutput) -> StepShape:
        return StepShape.of([c.seq.num_tokens for c in schedule.decodes],
                            [(c.start, c.num_tokens) for c in schedule.prefills])

    def finish_step(self, schedule: SchedulerOutput) -> list[StepOutput]:
        """Advances every scheduled sequence as ``LLMEngine.step`` does after the forward."""
        for chunk in schedule.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        outputs = []
        for chunk in schedule.chunks:
            seq = chunk.seq
            if not chunk.completes:
                self.blocks.commit_full_blocks(seq)
                continue
            seq.token_ids.append(SAMPLED_TOKEN)
            self.blocks.commit_full_blocks(seq)
            first = seq.num_output_tokens == 1
            finished = seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.limits.max_model_len
            prefilled = seq.prefill_only and not finished
            if finished or prefilled:
                self.scheduler.remove(seq)
                del self.requests[seq.request_id]
                seq.status = SequenceStatus.FINISHED
                if prefilled:
                    self.prefilled[seq.request_id] = seq
                else:
                    self.blocks.free(seq)
            outputs.append(StepOutput(seq.request_id, first, finished, prefilled))
        return outputs

    # -- what the router sees ------------------------------------------------------------------
    def queued_prefill_tokens(self) -> int:
        pending = [*self.scheduler.waiting, *(s for s in self.scheduler.running if s.is_prefilling)]
        return sum(s.num_tokens - s.num_computed_tokens for s in pending)

    def stats(self, address: str, role: str, prefill_tokens_per_s: float) -> pb.WorkerStats:
        """What the worker's GetStats would answer (the fields routing reads)."""
        b = self.blocks.stats()
        return pb.WorkerStats(
            address=address, role=role, healthy=True, blocks_total=b.num_blocks, blocks_free=b.num_free,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            block_size=self.limits.block_size, max_num_seqs=self.limits.max_num_seqs,
            queued_prefill_tokens=self.queued_prefill_tokens(), cached_block_hashes=list(self.blocks.cached),
            prefill_tokens_per_s=prefill_tokens_per_s,
        )


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
