"""Speculative decoding: decoding sequences propose tokens, one forward pass verifies them.

``--speculative ngram`` looks proposals up in the sequence itself (``ngram.py``);
``--speculative draft --draft-model PATH`` runs a smaller model (``draft.py``).
``speculator.py`` hooks both into the engine's step; ``verify.py`` keeps the output exact;
``backoff.py`` stops proposing where it does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.model import CausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.speculative.draft import DraftProposer
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.speculator import SpecStats, Speculator

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

__all__ = ["DraftModel", "SpecStats", "Speculator", "attach", "load_draft"]


@dataclass(frozen=True, slots=True)
class DraftModel:
    model: CausalLM
    layout: KVLayout

    @property
    def block_bytes(self) -> int:
        """One block of the draft's cache, all layers (it shares the target's KV budget)."""
        return self.layout.block_bytes * self.layout.num_layers


def load_draft(engine: LLMEngine) -> DraftModel:
    """The draft model of ``engine.config`` (the target's own model object when it is the same
    folder). Raises ValueError naming ``draft_model`` when it cannot propose for the target."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.model_store import resolve_model
    from pdserve.kernels import select_backend

    config = engine.config
    try:
        folder = resolve_model(config.draft_model, config.cache_dir)
        draft_config = ModelConfig.from_folder(folder)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"draft_model: {e}") from None
    if draft_config.vocab_size != engine.model_config.vocab_size:
        raise ValueError(
            f"draft_model: its vocabulary of {draft_config.vocab_size} tokens is not the target's "
            f"{engine.model_config.vocab_size}"
        )
    layout = KVLayout.for_model(draft_config, config.block_size, engine.dtype, config.kv_cache_dtype)
    if Path(folder).resolve() == Path(engine.model_dir).resolve():
        return DraftModel(engine.model, layout)  # its own draft: the weights are shared, the cache is not
    backend = select_backend(engine.device, config.attention_backend, layout.format)
    return DraftModel(load_model(folder, engine.dtype, engine.device, backend, config.quantization), layout)


def attach(engine: LLMEngine, draft: DraftModel | None, num_blocks: int) -> Speculator:
    """Builds the speculator of ``engine.config`` and hooks it into the scheduler and the runner."""
    config = engine.config
    if config.speculative == "ngram":
        proposer: NgramProposer | DraftProposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        assert draft is not None
        proposer = DraftProposer(draft.model, draft.layout, num_blocks, engine.device)
    speculator = Speculator(
        proposer, config.num_speculative_tokens, engine.scheduler, engine.blocks, engine.max_model_len
    )
    engine.scheduler.lookahead = speculator.lookahead
    engine.runner.sampling.verify = speculator.verify
    return speculator
