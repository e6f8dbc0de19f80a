"""n > 1: several choices from one prompt, prefilled (and handed off) once.

The prompt runs as one sequence. When its last position's logits are ready, the sampling step
draws every choice's first token from that one row (choice ``i`` with its own noise,
``choice_seed(seed, i)``). Then the sequence forks: choice 0 continues as the sequence itself;
each other choice becomes a sequence that shares the prompt's full KV blocks (reference
counted) and gets one fresh block: a copy of the prompt's partial last block (copy-on-write,
done at once since every choice writes its own next token into that block in the next step)
or, when the prompt ends on a block boundary, the block for its first token. A fork that
finds no free block waits in the queue and recomputes its prompt (prefix-cache hits make
that cheap), as a preempted sequence would.

On a prefill worker nothing forks: the first tokens travel with the K/V (choice 0's as the
transfer's first token, the others with it) and the decode worker forks when they land.
A choice that ends at once (EOS as its first token) is finished where it was sampled.

Stop strings are matched by the router, on text; when a choice meets one while others go on,
the router asks the worker to end it (``Choices.end``), so it stops holding a batch slot and
blocks. A choice ended before its request forked (its K/V still arriving) ends as it forks.

Seeds: choice 0 keeps the request's seed, so its tokens equal those of the same request with
n = 1; choice ``i`` > 0 uses a seed derived from (seed, i): distinct and reproducible, on any
worker, after preemption or migration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.logprobs import TokenLogprob, take_prompt_logprobs
from pdserve.engine.request_output import FirstToken, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.request_rules import choice_seed

if TYPE_CHECKING:
    from pdserve.engine.kv_connector import KVConnector
    from pdserve.engine.parallel.rank_caches import KVShards

FinishCheck = Callable[[Sequence, int], "FinishReason | None"]


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The settings choice ``index`` samples with (one sequence, its own seed)."""
    return replace(sampling, n=1, seed=choice_seed(sampling.seed, index), prompt_logprobs=None)


def needs_fork(seq: Sequence) -> bool:
    """Whether ``seq``'s next sample draws the first token of all its choices."""
    return seq.sampling.n > 1 and seq.group is None and seq.choice == 0


@dataclass(eq=False, slots=True)
class ChoiceGroup:
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def request_finished(seq: Sequence) -> bool:
    """Whether ``seq`` finishing ends its request (every choice has finished)."""
    return seq.group is None or seq.group.finished


def sequence_output(
    seq: Sequence, token_ids: list[int], reason: FinishReason | None, logprob: TokenLogprob | None, **extra
) -> RequestOutput:
    """One choice's new tokens; ``finished`` only once its request's last choice has finished."""
    return RequestOutput(
        seq.request_id,
        token_ids,
        reason,
        seq.num_prompt_tokens,
        seq.num_cached_tokens,
        finished=reason is not None and request_finished(seq),
        index=seq.choice,
        logprobs=[logprob] if logprob is not None else None,
        prompt_logprobs=take_prompt_logprobs(seq),
        **extra,
    )


class Choices:
    """Starts a request's choices once their first tokens are known, and ends some of them
    early when the router asks (engine thread)."""

    def __init__(
        self,
        blocks: BlockManager,
        scheduler: Scheduler,
        connector: KVConnector,
        kv_shards: KVShards | None,
        grammar_state: Callable[[Sequence], object],
        finish_reason: FinishCheck,
    ) -> None:
        self.blocks = blocks
        self.scheduler = scheduler
        self.connector = connector
        self.kv_shards = kv_shards  # every rank's cache (None: a multi-GPU worker's, out of reach)
        self.grammar_state = grammar_state
        self.finish_reason = finish_reason
        self.num_forks = 0
        self.num_recomputed = 0  # forks that found no free block and re-prefill instead
        self.num_ended = 0  # ended by the router (``end``) while others went on

    def start(self, seq: Sequence, first: list[tuple[int, TokenLogprob | None]], emit: bool) -> list[RequestOutput]:
        """``seq`` holds its prompt and choice 0's first token; ``first`` has every choice's.
        A prefill worker sends them all with the K/V; elsewhere the choices fork here. ``emit``:
        return each choice's first token (False where the router already has them)."""
        if seq.kv_send is not None:
            reasons = [self.finish_reason(seq, token_id) for token_id, _ in first]
            firsts = [FirstToken(t, r, lp) for (t, lp), r in zip(first, reasons)]
            ended = all(r is not None for r in reasons)
            if ended:
                self.scheduler.finish(seq, reasons[0])
            else:
                self.connector.prompt_done(seq, tuple(t for t, _ in first[1:]))
            out = sequence_output(seq, [first[0][0]], reasons[0], first[0][1], first_tokens=firsts)
            out.finished = ended  # otherwise the request ends with the decode side's acknowledgement
            return [out]
        choices = self.fork(seq, [t for t, _ in first])
        reasons = [
            FinishReason.STOP
            if choice.choice in seq.ended_choices
            else self.finish_reason(choice, choice.last_token_id)
            for choice in choices
        ]
        self.num_ended += len(seq.ended_choices & {c.choice for c in choices})
        for choice, reason in zip(choices[1:], reasons[1:]):
            if reason is None:
                self.admit(seq, choice)  # before the parent may free its blocks
            else:
                choice.status, choice.finish_reason = SequenceStatus.FINISHED, reason
        if reasons[0] is not None:
            self.scheduler.finish(seq, reasons[0])
        outputs = [sequence_output(c, [t], r, lp) for c, (t, lp), r in zip(choices, first, reasons) if emit]
        if not emit and seq.group.finished:  # nothing goes on: the request ends here
            outputs.append(
                RequestOutput(
                    seq.request_id, [], reasons[0], seq.num_prompt_tokens, seq.num_cached_tokens, finished=True
                )
            )
        if outputs and seq.group.finished:  # the request ends with the last output, however they were ordered
            for out in outputs:
                out.finished = out is outputs[-1]
        return outputs

    def end(self, seq: Sequence, indices: Iterable[int]) -> list[RequestOutput]:
        """Ends choices ``indices`` of ``seq``'s request while its other choices go on (the
        router found a stop string in them); returns an output for each that was still
        generating. Choices not forked yet end as they fork (``start``)."""
        ending = frozenset(indices)
        if seq.group is None:
            seq.ended_choices |= ending
            return []
        outputs = []
        for choice in seq.group.seqs:
            if choice.choice in ending and not choice.is_finished:
                self.scheduler.finish(choice, FinishReason.STOP)
                outputs.append(sequence_output(choice, [], FinishReason.STOP, None))
        self.num_ended += len(outputs)
        return outputs

    def fork(self, parent: Sequence, first_token_ids: list[int]) -> list[Sequence]:
        """``parent`` holds the prompt and choice 0's first token (K/V computed up to it);
        returns every choice's sequence, ``parent`` first. Children are not yet scheduled:
        ``admit`` them once their first token is known not to end them."""
        prompt = parent.token_ids[: parent.num_tokens - 1]
        group = ChoiceGroup([parent])
        parent.group = group
        for index, token_id in enumerate(first_token_ids[1:], start=1):
            child = Sequence(
                parent.request_id,
                prompt + [token_id],
                parent.num_prompt_tokens,
                choice_sampling(parent.sampling, index),
                priority=parent.priority,
                arrival_time=parent.arrival_time,
                num_prior_output_tokens=parent.num_prior_output_tokens,
                choice=index,
                group=group,
            )
            child.grammar = self.grammar_state(child)
            group.seqs.append(child)
        self.num_forks += len(group.seqs) - 1
        return group.seqs

    def admit(self, parent: Sequence, child: Sequence) -> None:
        """Shares ``parent``'s prompt blocks with ``child`` and puts it in the running batch, or,
        without a free block or room in the batch (``max_num_seqs``), queues it to recompute
        its prompt (from the prefix cache, where it is on)."""
        copies = self.blocks.fork(parent, child) if self.scheduler.has_room() else None
        if copies and self.kv_shards is None:  # the partial block cannot be copied on every rank
            self.blocks.free(child)
            child.num_cached_tokens = 0
            copies = None
        if copies is None:
            self.num_recomputed += 1
            self.scheduler.add(child)
            return
        for src, dst in copies:  # every layer of every rank: rank 0's cache alone is only its heads
            for layer in self.kv_shards.layers:
                layer[dst] = layer[src]
        child.status = SequenceStatus.RUNNING
        child.admitted_at = parent.admitted_at
        self.scheduler.running.append(child)
