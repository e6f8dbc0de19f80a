"""The in-process engine both worker roles wrap: add requests, step, collect outputs, abort.

One thread owns it and calls every method, except ``reserve_blocks``, ``free_blocks`` and
``stats``, which other threads may call: they and the bookkeeping parts of ``step`` take
``self.lock`` (the forward pass itself runs without it, so a reservation never waits for a
step to finish). Besides
plain generation it offers the seam for disaggregation: a request can stop after its
prefill and hand out its KV blocks (``prefill_only`` + ``take_prefilled``), and a request
can start decoding from KV blocks that were filled from outside (``reserve_blocks`` +
``add_prefilled``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv_cache import KVCache, KVLayout, num_blocks_for_budget, parse_memory
from pdserve.engine.loader import load_model, parse_dtype, pick_device
from pdserve.engine.model import LayerHook
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_store import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.swap import SwapSpace
from pdserve.kernels import select_backend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    running: int
    waiting: int
    prefilled_held: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    evictions: int
    queued_prefill_tokens: int = 0
    cached_block_hashes: tuple[int, ...] = ()
    prefill_tokens_per_s: float = 0.0
    rejected: int = 0


@dataclass(frozen=True, slots=True)
class PrefilledKV:
    """A finished prefill whose blocks the engine holds until ``release``."""

    request_id: str
    token_ids: list[int]  # prompt + the first generated token
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose K/V are in ``block_ids`` (the prompt)


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
        num_blocks = num_blocks_for_budget(self.kv_layout, config.kv_cache_memory, self.device)
        storage = kv_storage(self.kv_layout, num_blocks) if kv_storage else None
        self.kv_cache = KVCache(self.kv_layout, num_blocks, self.device, storage)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap = self._swap_space(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill),
            self.blocks, self.swap,
        )
        self.runner = ModelRunner(self.model, self.kv_cache.layers, config.block_size, self.device)
        self.requests: dict[str, Sequence] = {}
        self.prefilled: dict[str, Sequence] = {}
        self.lock = threading.RLock()
        self.prefill_rate = 0.0  # tokens/s of recent prefill steps (an EMA), for TTFT estimates
        # Set by a prefill worker: called with each step's schedule, returns a hook run after
        # every layer so that layer's K/V can leave while the next layer computes.
        self.on_forward: Callable[[SchedulerOutput], LayerHook | None] | None = None
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
        prefill_only: bool = False,
        num_prior_output_tokens: int = 0,
        ttft_budget_s: float | None = None,
    ) -> None:
        """Queues a request. ``num_prior_output_tokens``: how many of the prompt's last tokens
        were generated earlier (a migrated or resumed request). ``ttft_budget_s``: reject the
        request (finish reason ``rejected``) if it has not started by then."""
        if ttft_budget_s is not None and not ttft_budget_s > 0:
            raise ValueError(f"ttft_budget_ms: must be > 0, got {ttft_budget_s * 1e3}")
        if request_id in self.requests or request_id in self.prefilled:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling, num_prior_output_tokens)
        seq = Sequence(
            request_id, list(prompt_token_ids), len(prompt_token_ids), sampling,
            priority=priority, prefill_only=prefill_only, num_prior_output_tokens=num_prior_output_tokens,
        )
        if ttft_budget_s is not None:
            seq.start_deadline = seq.arrival_time + ttft_budget_s
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown."""
        if request_id in self.prefilled:
            self.release(request_id)
            return True
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        with self.lock:
            self.scheduler.remove(seq)
            self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            schedule = self.scheduler.schedule()
            rejected = [self._reject(seq) for seq in schedule.expired]
        if schedule.empty:
            return rejected
        hook = self.on_forward(schedule) if self.on_forward else None
        started = time.perf_counter()
        sampled = self.runner.run(schedule, hook)
        if schedule.prefills:
            tokens = sum(c.num_tokens for c in schedule.prefills) + len(schedule.decodes)
            rate = tokens / max(time.perf_counter() - started, 1e-6)
            self.prefill_rate = rate if not self.prefill_rate else 0.8 * self.prefill_rate + 0.2 * rate

        with self.lock:
            for chunk in schedule.chunks:
                chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            outputs = []
            for chunk, token_id in sampled:
                seq = chunk.seq
                seq.token_ids.append(token_id)
                self.blocks.commit_full_blocks(seq)
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    self._finish(seq, reason)
                outputs.append(RequestOutput(seq.request_id, [token_id], reason, seq.num_prompt_tokens, seq.num_cached_tokens))
            for chunk in schedule.prefills:
                if not chunk.completes:
                    self.blocks.commit_full_blocks(chunk.seq)
        return rejected + outputs

    def _reject(self, seq: Sequence) -> RequestOutput:
        del self.requests[seq.request_id]
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.REJECTED
        return RequestOutput(seq.request_id, [], FinishReason.REJECTED, seq.num_prompt_tokens, 0)

    def stats(self, with_digest: bool = False) -> EngineStats:
        """``with_digest``: include the hashes of every cached block (for KV-aware routing)."""
        with self.lock:
            b = self.blocks.stats()
            pending = [*self.scheduler.waiting, *(s for s in self.scheduler.running if s.is_prefilling)]
            return EngineStats(
                blocks_total=b.num_blocks, blocks_free=b.num_free, blocks_cached=b.num_cached,
                running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                prefilled_held=len(self.prefilled), preemptions=self.scheduler.num_preemptions,
                prefix_queries=b.prefix_queries, prefix_hits=b.prefix_hits, evictions=b.evictions,
                queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in pending),
                cached_block_hashes=tuple(self.blocks.cached) if with_digest else (),
                prefill_tokens_per_s=self.prefill_rate, rejected=self.scheduler.num_rejected,
            )

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sp = seq.sampling
        if (not sp.ignore_eos and token_id in self.model_config.eos_token_ids) or token_id in sp.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if seq.prefill_only:
            return FinishReason.PREFILLED
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        del self.requests[seq.request_id]
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq.prefill_only:
            self.prefilled[seq.request_id] = seq  # kept for export, even if already finished
        else:
            self.blocks.free(seq)

    # -- the disaggregation seam -------------------------------------------------------------
    def take_prefilled(self, request_id: str) -> PrefilledKV:
        seq = self.prefilled[request_id]
        return PrefilledKV(request_id, list(seq.token_ids), list(seq.block_table), seq.num_tokens - 1)

    def release(self, request_id: str) -> None:
        """Frees a finished prefill's blocks (they stay in the prefix cache until evicted)."""
        seq = self.prefilled.pop(request_id, None)
        if seq is not None:
            with self.lock:
                self.blocks.free(seq)

    def reserve_blocks(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        """Blocks for K/V that will arrive from elsewhere, sharing any cached prefix of
        ``token_ids``; returns (block ids, tokens already cached). MemoryError if they do not fit."""
        with self.lock:
            return self.blocks.allocate_for_tokens(token_ids, num_tokens)

    def free_blocks(self, block_ids: list[int]) -> None:
        with self.lock:
            self.blocks.free_blocks(block_ids)

    def add_prefilled(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        sampling: SamplingParams,
        block_ids: list[int],
        *,
        priority: int = 0,
        num_prior_output_tokens: int = 0,
        num_cached_tokens: int = 0,
    ) -> RequestOutput | None:
        """Starts decoding a request whose first ``len(token_ids) - 1`` tokens have K/V in
        ``block_ids`` and whose last token was sampled elsewhere. The blocks now belong to the
        engine (they are freed on every error). Returns a finished output if that last token
        already ends the request."""
        if request_id in self.requests:
            self.free_blocks(block_ids)
            raise ValueError(f"request_id: {request_id!r} is already in use")
        seq = Sequence(request_id, list(token_ids), num_prompt_tokens, sampling, priority=priority,
                       num_prior_output_tokens=num_prior_output_tokens)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(token_ids) - 1
        seq.num_cached_tokens = num_cached_tokens
        with self.lock:
            seq.block_hashes = [self.blocks.blocks[b].hash for b in block_ids[: num_cached_tokens // self.config.block_size]]
            if not self.blocks.ensure_capacity(seq, seq.num_tokens):
                self.blocks.free(seq)
                raise MemoryError("not enough free KV blocks")
            reason = self._finish_reason(seq, seq.last_token_id)
            if reason is not None and reason is not FinishReason.PREFILLED:
                self.blocks.free(seq)
                return RequestOutput(request_id, [], reason, num_prompt_tokens, 0)
            self.blocks.commit_full_blocks(seq)
            self.requests[request_id] = seq
            self.scheduler.add_running(seq)
        return None
