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
from typing import Callable, Iterable

import torch

from pdserve.engine import speculative
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.choices import Choices, sequence_output
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_stats import EngineStats, collect_stats
from pdserve.engine.kv_cache import KVCache, KVLayout, num_blocks_for_budget, parse_memory
from pdserve.engine.kv_connector import KVConnector, KVReceive, KVSend
from pdserve.engine.loader import load_model, parse_dtype, pick_device
from pdserve.engine.logprobs import start_prompt_logprobs
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_store import resolve_model
from pdserve.engine.packed_linear import packable
from pdserve.engine.parallel.rank_caches import KVShards
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.request_output import RequestOutput, RequestRejected
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.structured_output import GrammarCompiler
from pdserve.engine.swap import SwapSpace
from pdserve.engine.thread_budget import ThreadBudget
from pdserve.kernels import select_backend
from pdserve.request_rules import DEFAULT_MAX_TOKENS, check_prompt_tokens, check_sampling, check_ttft_budget_ms

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_dir: str | None = None,
        kv_storage: Callable[[KVLayout, int], torch.Tensor | None] | None = None,
    ) -> None:
        """``kv_storage(layout, num_blocks)`` may supply the cache tensor (shared memory, an IPC-able GPU allocation)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = model_dir or str(resolve_model(config.model, config.cache_dir))
        self.model_config = ModelConfig.from_folder(self.model_dir)
        # Judged once, before the weights load; read per token by the finish check.
        self.max_model_len = self.model_config.context_length(config.max_model_len)
        self.device = pick_device(config.device)
        self.dtype = parse_dtype(config.dtype, self.device)
        self.kv_layout = KVLayout.for_model(self.model_config, config.block_size, self.dtype, config.kv_cache_dtype)
        self.parallel = None  # rank 0 of a tensor/pipeline-parallel worker (engine/parallel)
        draft = None  # speculative decoding's draft model (single-rank workers only)
        if config.world_size > 1:
            from pdserve.engine.parallel.driver import ParallelDriver

            self.parallel = ParallelDriver(config, self.model_dir, self.device, kv_storage)
            self.model, self.kv_cache, self.kv_shards = (
                self.parallel.model,
                self.parallel.kv_cache,
                self.parallel.kv_shards,
            )
            forward, backend_name = self.parallel, f"{self.model.backend.name} x{config.world_size} ranks"
        else:
            backend = select_backend(self.device, config.attention_backend, self.kv_layout.format)
            self.model = forward = load_model(self.model_dir, self.dtype, self.device, backend, config.quantization)
            draft = speculative.load_draft(self) if config.speculative == "draft" else None  # shares the KV budget
            num_blocks = num_blocks_for_budget(
                self.kv_layout, config.kv_cache_memory, self.device, draft.block_bytes if draft else 0
            )
            try:
                storage = kv_storage(self.kv_layout, num_blocks) if kv_storage else None
                self.kv_cache = KVCache(self.kv_layout, num_blocks, self.device, getattr(storage, "tensor", storage))
            except (OSError, MemoryError, torch.OutOfMemoryError) as e:  # more than the machine (or /dev/shm) gives
                size = num_blocks * self.kv_layout.block_bytes * self.kv_layout.num_layers / 2**30
                raise ValueError(
                    f"kv_cache_memory {config.kv_cache_memory}: cannot allocate {size:.1f} GiB ({e})"
                ) from None
            self.kv_shards = KVShards(self.kv_cache.layers, self.kv_layout)  # the cache as the KV handoff sees it
            backend_name = backend.name
            if self._bf16_would_halve_weights(backend):
                log.info("--dtype bfloat16 streams half the weight bytes of auto's float32 on this CPU (faster decode)")
        num_blocks = self.kv_cache.num_blocks
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap = self._swap_space(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill),
            self.blocks,
            self.swap,
        )
        self.runner = ModelRunner(forward, self.kv_cache.layers, config.block_size, self.device)
        self.threads = ThreadBudget(config.borrow_threads, self.device, config.world_size)
        # Speculative decoding hooks into the scheduler (lookahead) and the runner (verify).
        self.speculator = speculative.attach(self, draft, num_blocks) if config.speculative != "none" else None
        self.connector = KVConnector(
            self.scheduler, self.blocks, self.model_config.num_layers, self.model_config.vocab_size, self._finish_reason
        )
        self.connector.pipelined = not self.threads.fills_cores  # no core left for a sender mid-forward
        # API parity: grammars for structured output, forks for n > 1 (engine/choices.py).
        self.grammars = GrammarCompiler(
            self.model_dir, self.model_config.vocab_size, sorted(self.model_config.eos_token_ids)
        )
        self.choices = Choices(
            self.blocks, self.scheduler, self.connector, self.kv_shards, self._grammar_state, self._finish_reason
        )
        self.connector.start_choices = lambda seq, token_ids: (
            self.choices.start(seq, [(t, None) for t in token_ids], emit=False) or [None]
        )[-1]
        self.requests: dict[str, Sequence] = {}
        self.prefill_rate = PrefillRate()  # for TTFT estimates
        self._digest: tuple[int, tuple[int, ...]] = (-1, ())  # (block cache version, its hashes)
        log.info(
            "engine loaded: %s %s on %s, %d KV blocks of %d tokens (%.0f MiB), attention=%s",
            self.model_config.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            num_blocks,
            config.block_size,
            self._kv_cache_bytes() / 2**20,
            backend_name,
        )
        if num_blocks * config.block_size < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens, less than one context of %d: requests that could outgrow it "
                "are refused (raise --kv-cache-memory or lower --max-model-len)",
                num_blocks * config.block_size,
                self.max_model_len,
            )

    def _bf16_would_halve_weights(self, backend) -> bool:
        """Whether ``auto`` resolved to fp32 weights that the packed bf16 kernel could stream at half
        the bytes (a quantized model's weights are its codes either way)."""
        config = self.config
        return (
            config.dtype == "auto"
            and config.quantization == "none"
            and self.dtype == torch.float32
            and packable(backend.cpu_kernels, torch.bfloat16)
        )

    def _kv_cache_bytes(self) -> int:
        """The KV cache's size: every rank's where the worker maps them all (CPU tensor or pipeline
        parallel), else this process's (one GPU's of a multi-GPU worker)."""
        if self.kv_shards is None:
            return self.kv_cache.nbytes
        return sum(layer.nbytes for layer in self.kv_shards.layers)

    @property
    def weights_id(self) -> str:
        """How the weights are computed ("bfloat16/int8"): K/V from two engines mix only when equal."""
        return f"{str(self.dtype).removeprefix('torch.')}/{self.config.quantization}"

    def _swap_space(self, num_blocks: int) -> SwapSpace | None:
        mode = self.config.preemption_mode
        if mode == "recompute" or (mode == "auto" and self.device.type != "cuda") or self.parallel is not None:
            return None
        nbytes, _ = parse_memory(self.config.swap_space, "swap_space")  # a size: EngineConfig checked
        host_blocks = min(num_blocks * 4, nbytes // (self.kv_layout.block_bytes * self.kv_layout.num_layers))
        return SwapSpace(self.kv_cache, host_blocks) if host_blocks else None

    def close(self) -> None:
        """Stops the other ranks of a parallel worker (nothing to do at TP 1)."""
        if self.parallel is not None:
            self.parallel.close()
            self.parallel = None

    # -- requests ---------------------------------------------------------------------------
    def validate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        num_prior_output_tokens: int = 0,
        generates: bool = True,
    ) -> None:
        """The router's rules (pdserve/request_rules.py) on what reached this worker, plus what
        only the worker knows. ``num_prior_output_tokens``: trailing prompt tokens generated
        earlier. ``generates``: the request decodes here (not only its prompt, for another worker)."""
        vocab = self.model_config.vocab_size
        check_prompt_tokens(prompt_token_ids, vocab_size=vocab, max_model_len=self.max_model_len)
        if not 0 <= num_prior_output_tokens < sampling.max_tokens:
            raise ValueError(f"num_prior_output_tokens: {num_prior_output_tokens} must be in [0, max_tokens)")
        check_sampling(
            sampling,
            vocab_size=vocab,
            prompt_len=len(prompt_token_ids) - num_prior_output_tokens,
            max_model_len=self.max_model_len,
        )
        if self.blocks.blocks_needed(len(prompt_token_ids) + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt_token_ids: {len(prompt_token_ids)} tokens do not fit this worker's KV cache")
        if generates:  # a sequence that outgrew the whole cache could never run again
            new_tokens = sampling.max_tokens - num_prior_output_tokens
            needed = self.blocks.blocks_needed(len(prompt_token_ids) + new_tokens) + (sampling.n - 1) * (
                self.blocks.blocks_needed(new_tokens) + 1  # each further choice: its own tail
            )
            if needed > self.blocks.num_blocks:
                raise ValueError(
                    f"sampling.max_tokens: {new_tokens} new tokens after a {len(prompt_token_ids)}-token prompt"
                    f"{f' for {sampling.n} choices' if sampling.n > 1 else ''} need {needed} KV blocks; this "
                    f"worker's cache has {self.blocks.num_blocks} of {self.blocks.block_size} tokens (unset, "
                    f"max_tokens asks for min({DEFAULT_MAX_TOKENS}, the context left): set it lower)"
                )

    def compile_constraint(self, sampling: SamplingParams) -> None:
        """Compiles the request's structured-output constraint (cached), raising ``InvalidRequest``
        if the grammar engine refuses it. Thread-safe: workers call it off the engine thread, so
        ``add_request`` finds it compiled."""
        if sampling.constraint is not None:
            self.grammars.compile(sampling.constraint)

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
        if ttft_budget_s is not None:
            check_ttft_budget_ms(ttft_budget_s * 1e3)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if kv_send is not None and kv_receive is not None:
            raise ValueError("a request either sends its KV or receives it, not both")
        self.validate(prompt_token_ids, sampling, num_prior_output_tokens, generates=kv_send is None)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            len(prompt_token_ids),
            sampling,
            priority=priority,
            num_prior_output_tokens=num_prior_output_tokens,
            kv_send=kv_send,
            kv_receive=kv_receive,
        )
        if ttft_budget_s is not None:
            seq.start_deadline = seq.arrival_time + ttft_budget_s
        if kv_receive is None:  # the prompt runs here
            start_prompt_logprobs(seq)
        seq.grammar = self._grammar_state(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for choice in seq.group.seqs if seq.group is not None else [seq]:
            if choice.is_finished:
                continue
            if not self.connector.abort(choice):
                self.scheduler.remove(choice)
                self.blocks.free(choice)
            choice.status, choice.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        return True

    def end_choices(self, request_id: str, indices: Iterable[int]) -> list[RequestOutput]:
        """n > 1: ends choices ``indices`` of a request whose other choices go on (``Choices.end``)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return []
        outputs = self.choices.end(seq, indices)
        if outputs and seq.group.finished:
            self.requests.pop(request_id, None)
        return outputs

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
            outputs.append(
                RequestOutput.failed(seq.request_id, RequestRejected("could not start in time"), seq.num_prompt_tokens)
            )
        outputs += [self.connector.open_grant(seq) for seq in schedule.reserved]
        if not schedule.empty:
            outputs += self._forward(schedule)
        elif self.speculator is not None:
            self.speculator.drop_finished()  # an idle engine still lets go of aborted requests' draft blocks
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _forward(self, schedule: SchedulerOutput) -> list[RequestOutput]:
        hook = self.connector.save_hook(schedule)
        # Borrows an idle prefill worker's cores for a decode-only step (engine/thread_budget.py).
        self.threads.for_step(bool(schedule.prefills), bool(self.scheduler.waiting_for_kv))
        if self.speculator is not None:
            self.speculator.propose(schedule)
        started = time.perf_counter()
        sampled = self.runner.run(schedule, hook)
        self.prefill_rate.observe(sum(c.num_tokens for c in schedule.prefills), time.perf_counter() - started)

        for chunk in schedule.chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        outputs = []
        for s in sampled:
            seq = s.chunk.seq
            if s.choices:  # n > 1: every choice's first token was drawn from this prompt
                seq.token_ids.append(s.token_ids[0])
                self.blocks.commit_full_blocks(seq)
                outputs += self.choices.start(seq, s.choices, emit=True)
                continue
            new_ids: list[int] = []
            reason = None
            for token_id in s.token_ids:  # several with accepted speculative tokens; none past a finish
                seq.token_ids.append(token_id)
                new_ids.append(token_id)
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    break
            if len(new_ids) < len(s.token_ids):  # what follows a finish never happened (counted so)
                del s.token_ids[len(new_ids) :]
                s.cut_at_finish = True
            seq.num_computed_tokens = seq.num_tokens - 1  # every token but the newest is in the cache
            self.blocks.commit_full_blocks(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            elif seq.kv_send is not None:
                self.connector.prompt_done(seq)  # keeps its blocks until the decode side has the K/V
            outputs.append(sequence_output(seq, new_ids, reason, s.logprob))
        for chunk in schedule.prefills:
            if not chunk.completes:
                self.blocks.commit_full_blocks(chunk.seq)
        if self.speculator is not None:
            self.speculator.step_done(schedule, sampled)
        return outputs

    def _grammar_state(self, seq: Sequence):
        return self.grammars.state(seq.sampling.constraint) if seq.sampling.constraint is not None else None

    def stats(self, with_digest: bool = False) -> EngineStats:
        """``with_digest``: include the hashes of every cached block (for KV-aware routing)."""
        return collect_stats(
            self.scheduler,
            self.connector,
            cached_block_hashes=self._cached_hashes() if with_digest else (),
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
            forks=self.choices.num_forks,
            ended_choices=self.choices.num_ended,
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
