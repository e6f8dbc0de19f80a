"""The in-process engine both worker roles wrap: add requests, step, collect outputs, abort.

One thread owns it (``engine_loop.EngineLoop``) and calls every method; other threads only
read the stats snapshot it publishes. The KV handoff is a request parameter: ``kv_send`` ships
a request's prompt K/V to a decode worker as it is computed and holds the blocks until they
are acknowledged; ``kv_receive`` reserves blocks for a prompt whose K/V a prefill worker
sends, and decodes once they have landed (see ``kv_connector``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine import speculative
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv_cache import KVCache, KVLayout, num_blocks_for_budget, parse_memory
from pdserve.engine.kv_connector import KVConnector, KVReceive, KVSend
from pdserve.engine.loader import load_model, parse_dtype, pick_device
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_store import resolve_model
from pdserve.engine.request_output import RequestOutput, RequestRejected
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.swap import SwapSpace
from pdserve.kernels import select_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    running: int
    waiting: int
    prefilled_held: int  # prefills whose blocks wait for the decode side's acknowledgement
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    evictions: int
    queued_prefill_tokens: int = 0
    cached_block_hashes: tuple[int, ...] = ()
    prefill_tokens_per_s: float = 0.0
    rejected: int = 0
    waiting_for_kv: int = 0  # reservations whose K/V a prefill worker is sending
    spec: speculative.SpecStats | None = None  # speculative decoding's counters, when it is on


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model_dir: str | None = None,
                 kv_storage: Callable[[KVLayout, int], torch.Tensor | None] | None = None) -> None:
        """``kv_storage(layout, num_blocks)`` may supply the cache tensor (shared memory, an IPC-able GPU allocation)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = model_dir or str(resolve_model(config.model, config.cache_dir))
        self.model_config = ModelConfig.from_folder(self.model_dir)
        self.device = pick_device(config.device)
        self.dtype = parse_dtype(config.dtype, self.device)
        self.kv_layout = KVLayout.for_model(self.model_config, config.block_size, self.dtype, config.kv_cache_dtype)
        backend = select_backend(self.device, config.attention_backend, self.kv_layout.format)
        self.model = load_model(self.model_dir, self.dtype, self.device, backend, config.quantization)
        draft = speculative.load_draft(self) if config.speculative == "draft" else None  # shares the KV budget
        num_blocks = num_blocks_for_budget(self.kv_layout, config.kv_cache_memory, self.device,
                                           draft.block_bytes if draft else 0)
        storage = kv_storage(self.kv_layout, num_blocks) if kv_storage else None
        self.kv_cache = KVCache(self.kv_layout, num_blocks, self.device, storage)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap = self._swap_space(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill),
            self.blocks, self.swap,
        )
        self.runner = ModelRunner(self.model, self.kv_cache.layers, config.block_size, self.device)
        # Speculative decoding hooks into the scheduler (lookahead) and the runner (verify).
        self.speculator = speculative.attach(self, draft, num_blocks) if config.speculative != "none" else None
        self.connector = KVConnector(self.scheduler, self.blocks, self.model_config.num_layers, self.model_config.vocab_size,
                                     self._finish_reason)
        self.requests: dict[str, Sequence] = {}
        self.prefill_rate = 0.0  # tokens/s of recent prefill steps (an EMA), for TTFT estimates
        self._digest: tuple[int, tuple[int, ...]] = (-1, ())  # (block cache version, its hashes)
        log.info(
            "engine loaded: %s %s on %s, %d KV blocks of %d tokens (%.0f MiB), attention=%s",
            self.model_config.architecture, str(self.dtype).removeprefix("torch."), self.device, num_blocks, config.block_size,
            self.kv_cache.nbytes / 2**20, backend.name,
        )

    def _swap_space(self, num_blocks: int) -> SwapSpace | None:
        mode = self.config.preemption_mode
        if mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {mode!r}")
        if mode == "recompute" or (mode == "auto" and self.device.type != "cuda"):
            return None
        nbytes, fraction = parse_memory(self.config.swap_space)
        if fraction is not None:
            raise ValueError("swap_space must be a size such as '4GiB'")
        host_blocks = min(num_blocks * 4, nbytes // (self.kv_layout.block_bytes * self.kv_layout.num_layers))
        return SwapSpace(self.kv_cache, host_blocks) if host_blocks else None

    # -- requests ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams, num_prior_output_tokens: int = 0) -> None:
        """``num_prior_output_tokens``: trailing prompt tokens that were generated earlier."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: the prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(prompt_token_ids)} tokens leave no room in the model's context of {self.max_model_len}"
            )
        if not 0 <= num_prior_output_tokens < sampling.max_tokens:
            raise ValueError(f"num_prior_output_tokens: {num_prior_output_tokens} must be in [0, max_tokens)")
        if len(prompt_token_ids) - num_prior_output_tokens + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {len(prompt_token_ids) - num_prior_output_tokens} prompt tokens + max_tokens "
                f"{sampling.max_tokens} exceed the model's context of {self.max_model_len}"
            )
        sampling.check_vocab(vocab)
        if self.blocks.blocks_needed(len(prompt_token_ids) + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt_token_ids: {len(prompt_token_ids)} tokens do not fit this worker's KV cache")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        num_prior_output_tokens: int = 0,
        ttft_budget_s: float | None = None,
        kv_send: KVSend | None = None,
        kv_receive: KVReceive | None = None,
    ) -> None:
        """Queues a request. ``num_prior_output_tokens``: how many of the prompt's last tokens
        were generated earlier (a migrated or resumed request). ``ttft_budget_s``: reject the
        request (``RequestRejected``) if it has not started by then; with ``kv_receive``, this
        bounds the wait for free blocks. ``kv_send``/``kv_receive``: the KV handoff."""
        if ttft_budget_s is not None and not ttft_budget_s > 0:
            raise ValueError(f"ttft_budget_ms: must be > 0, got {ttft_budget_s * 1e3}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if kv_send is not None and kv_receive is not None:
            raise ValueError("a request either sends its KV or receives it, not both")
        self.validate(prompt_token_ids, sampling, num_prior_output_tokens)
        seq = Sequence(
            request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, priority=priority,
            num_prior_output_tokens=num_prior_output_tokens, kv_send=kv_send, kv_receive=kv_receive,
        )
        if ttft_budget_s is not None:
            seq.start_deadline = seq.arrival_time + ttft_budget_s
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if not self.connector.abort(seq):
            self.scheduler.remove(seq)
            self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.connector.num_releasing > 0

    def next_deadline(self) -> float | None:
        """When the engine must step again even if nothing else happens (a start deadline, an overdue ack)."""
        deadlines = [d for d in (self.scheduler.next_deadline(), self.connector.next_deadline()) if d is not None]
        return min(deadlines, default=None)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling round: apply finished transfers, admit, run one forward pass (if
        anything is scheduled) and return every request's new outputs."""
        outputs = self.connector.drain()
        schedule = self.scheduler.schedule()
        for seq in schedule.expired:
            seq.status = SequenceStatus.FINISHED
            outputs.append(RequestOutput.failed(seq.request_id, RequestRejected("could not start in time"), seq.num_prompt_tokens))
        outputs += [self.connector.open_grant(seq) for seq in schedule.reserved]
        if not schedule.empty:
            outputs += self._forward(schedule)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _forward(self, schedule: SchedulerOutput) -> list[RequestOutput]:
        hook = self.connector.save_hook(schedule)
        if self.speculator is not None:
            self.speculator.propose(schedule)
        started = time.perf_counter()
        sampled = self.runner.run(schedule, hook)
        if schedule.prefills:
            tokens = sum(c.num_tokens for c in schedule.prefills) + len(schedule.decodes)
            rate = tokens / max(time.perf_counter() - started, 1e-6)
            self.prefill_rate = rate if not self.prefill_rate else 0.8 * self.prefill_rate + 0.2 * rate

        for chunk in schedule.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        outputs = []
        for chunk, token_ids in sampled:
            seq = chunk.seq
            new_ids: list[int] = []
            reason = None
            for token_id in token_ids:  # several with accepted speculative tokens; none past a finish
                seq.token_ids.append(token_id)
                new_ids.append(token_id)
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    break
            seq.num_computed_tokens = seq.num_tokens - 1  # every token but the newest is in the cache
            self.blocks.commit_full_blocks(seq)
            if reason is not None:
                self._finish(seq, reason)
            elif seq.kv_send is not None:
                self.connector.prompt_done(seq)  # keeps its blocks until the decode side has the K/V
            outputs.append(RequestOutput(seq.request_id, new_ids, reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                                         finished=reason is not None))
        for chunk in schedule.prefills:
            if not chunk.completes:
                self.blocks.commit_full_blocks(chunk.seq)
        if self.speculator is not None:
            self.speculator.step_done(schedule, sampled)
        return outputs

    def stats(self, with_digest: bool = False) -> EngineStats:
        """``with_digest``: include the hashes of every cached block (for KV-aware routing)."""
        b = self.blocks.stats()
        pending = [*self.scheduler.waiting, *(s for s in self.scheduler.running if s.is_prefilling)]
        return EngineStats(
            blocks_total=b.num_blocks, blocks_free=b.num_free, blocks_cached=b.num_cached,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            prefilled_held=len(self.connector.sending), preemptions=self.scheduler.num_preemptions,
            prefix_queries=b.prefix_queries, prefix_hits=b.prefix_hits, evictions=b.evictions,
            queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in pending if s.kv_receive is None),
            cached_block_hashes=self._cached_hashes() if with_digest else (),
            prefill_tokens_per_s=self.prefill_rate, rejected=self.scheduler.num_rejected,
            waiting_for_kv=len(self.scheduler.waiting_for_kv),
            spec=self.speculator.stats if self.speculator is not None else None,
        )

    def _cached_hashes(self) -> tuple[int, ...]:
        if self._digest[0] != self.blocks.cache_version:
            self._digest = (self.blocks.cache_version, tuple(self.blocks.cached))
        return self._digest[1]

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sp = seq.sampling
        if (not sp.ignore_eos and token_id in self.model_config.eos_token_ids) or token_id in sp.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.kv_send is not None:
            seq.kv_send.transfer.cancel()  # the first token ends it: the decode side is not needed
        self.scheduler.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
