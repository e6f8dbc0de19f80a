"""How one worker splits a model over its ranks: tensor parallel (Megatron) and pipeline stages.

Ranks form a grid, ``rank = stage * tp + tp_rank``: the ``tp`` ranks of a stage share its layers
(q/k/v and gate/up split by output, o and down by input), the ``pp`` stages take consecutive
layers. Rank 0 (stage 0, tp rank 0) is the worker itself: it runs the scheduler.

KV heads follow vLLM's rule: with ``tp`` at most the KV heads, each rank holds ``heads / tp``
of them; with more ranks than KV heads, each rank holds one head and each head is replicated
on ``tp / heads`` ranks. Everything here is arithmetic on the model's shape; the same rules
decide which prefill rank ships which head to which decode rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensor_parallel_size", self.tp), ("pipeline_parallel_size", self.pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def check(self, config: ModelConfig) -> None:
        """Raises ValueError, naming the numbers, when the model cannot be split this way."""
        problem = tp_problem(self.tp, config)
        if problem is not None:
            valid = ", ".join(str(t) for t in range(1, 65) if tp_problem(t, config) is None)
            raise ValueError(f"{problem} (sizes that fit this model: {valid})")
        if self.pp > config.num_layers:
            raise ValueError(f"pipeline_parallel_size {self.pp} exceeds the model's {config.num_layers} layers")

    # -- what a rank holds ------------------------------------------------------------------------
    def stage_layers(self, stage: int, num_layers: int) -> range:
        """The layers of a stage: consecutive, the first ``num_layers % pp`` stages one more."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        return next(s for s in range(self.pp) if layer in self.stage_layers(s, num_layers))

    def q_heads(self, tp_rank: int, num_heads: int) -> range:
        per = num_heads // self.tp
        return range(tp_rank * per, (tp_rank + 1) * per)

    def kv_heads(self, tp_rank: int, num_kv_heads: int) -> range:
        return kv_heads_of(tp_rank, num_kv_heads, self.tp)

    def vocab_rows(self, tp_rank: int, vocab_size: int) -> range:
        """This rank's rows of the embedding and lm_head; every shard has ``vocab_shard_size`` rows,
        the last one padded past the vocabulary."""
        per = self.vocab_shard_size(vocab_size)
        return range(tp_rank * per, min((tp_rank + 1) * per, vocab_size))

    def vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp)


def tp_problem(tp: int, config: ModelConfig) -> str | None:
    """Why ``tp`` ranks cannot split this model, or None."""
    if config.num_heads % tp:
        return f"tensor_parallel_size {tp} does not divide the model's {config.num_heads} query heads"
    kv = kv_split_problem(config.num_kv_heads, tp)
    if kv is not None:
        return kv
    if config.intermediate_size % tp:
        return f"tensor_parallel_size {tp} does not divide the MLP's intermediate size {config.intermediate_size}"
    return None


def kv_split_problem(num_kv_heads: int, tp: int) -> str | None:
    if tp <= num_kv_heads and num_kv_heads % tp:
        return f"tensor_parallel_size {tp} does not divide the model's {num_kv_heads} KV heads"
    if tp > num_kv_heads and tp % num_kv_heads:
        return (
            f"tensor_parallel_size {tp} is more than the model's {num_kv_heads} KV heads but not a multiple "
            f"of them (each KV head must be replicated on the same number of ranks)"
        )
    return None


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    return max(1, num_kv_heads // tp)


def kv_heads_of(tp_rank: int, num_kv_heads: int, tp: int) -> range:
    """The global KV heads a TP rank holds (one replicated head when tp > num_kv_heads)."""
    problem = kv_split_problem(num_kv_heads, tp)
    if problem is not None:
        raise ValueError(problem)
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // num_kv_heads)
    return range(head, head + 1)
