"""Conversions between the wire messages and engine types (one place for both directions).

The router imports this module too, so it must not import torch: the engine's types it only
names in annotations come in for type checkers alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import Constraint
from pdserve.v1 import pdserve_pb2 as pb

if TYPE_CHECKING:
    from pdserve.engine.engine_stats import EngineStats
    from pdserve.engine.logprobs import TokenLogprob


def sampling_to_proto(sp: SamplingParams) -> pb.ResolvedSampling:
    return pb.ResolvedSampling(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        has_seed=sp.seed is not None,
        seed=sp.seed or 0,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=list(sp.stop_token_ids),
        n=sp.n,
        has_logprobs=sp.logprobs is not None,
        logprobs=sp.logprobs or 0,
        has_prompt_logprobs=sp.prompt_logprobs is not None,
        prompt_logprobs=sp.prompt_logprobs or 0,
        structured_output=constraint_to_proto(sp.constraint),
    )


def sampling_from_proto(msg: pb.ResolvedSampling) -> SamplingParams:
    """Raises ValueError on values a router should never have sent."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p),
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.has_seed else None,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        n=int(msg.n) or 1,
        logprobs=int(msg.logprobs) if msg.has_logprobs else None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.has_prompt_logprobs else None,
        constraint=constraint_from_proto(msg.structured_output),
    )


def constraint_to_proto(c: Constraint | None) -> pb.StructuredOutput | None:
    if c is None:
        return None
    if c.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=list(c.choices)))
    if c.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{c.kind: c.value})


def constraint_from_proto(msg: pb.StructuredOutput) -> Constraint | None:
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(kind, getattr(msg, kind))


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs
    )


def transfer_key(transfer_id: int) -> str:
    return f"{transfer_id:016x}"


def parse_transfer_key(key: str) -> int:
    try:
        value = int(key, 16)
    except ValueError:
        raise ValueError(f"transfer_id: {key!r} is not a transfer id") from None
    if not 0 <= value < 2**63:
        raise ValueError(f"transfer_id: {key!r} is out of range")
    return value


def worker_stats(
    stats: EngineStats,
    role: str,
    address: str,
    reserved: int = 0,
    kv_counters: Mapping[str, float] | None = None,
    block_size: int = 0,
    max_num_seqs: int = 0,
    max_model_len: int = 0,
) -> pb.WorkerStats:
    counters = {
        "preemptions": stats.preemptions,
        "prefix_queries": stats.prefix_queries,
        "prefix_hits": stats.prefix_hits,
        "evictions": stats.evictions,
        "blocks_cached": stats.blocks_cached,
        "prefilled_held": stats.prefilled_held,
        "rejected_ttft": stats.rejected,
        "forks": stats.forks,
        "ended_choices": stats.ended_choices,
    }
    if stats.spec is not None:  # speculative decoding
        counters.update(
            spec_drafts=stats.spec.drafts,
            spec_draft_tokens=stats.spec.draft_tokens,
            spec_accepted_tokens=stats.spec.accepted_tokens,
        )
    counters.update({f"kv_{k}": float(v) for k, v in (kv_counters or {}).items()})
    return pb.WorkerStats(
        address=address,
        role=role,
        healthy=True,
        blocks_total=stats.blocks_total,
        blocks_free=stats.blocks_free,
        running=stats.running,
        waiting=stats.waiting,
        reserved_transfers=reserved,
        counters=counters,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        cached_block_hashes=stats.cached_block_hashes,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        max_model_len=max_model_len,
    )
