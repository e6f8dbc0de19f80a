"""The router's tokenizer: prompts and chat messages to ids, ids back to streamed text."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

from pdserve.engine.model_config import ModelConfig
from pdserve.router.text_stream import CONTEXT_TOKENS, TextStream

log = logging.getLogger(__name__)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # what a model's generation_config.json may set


def tokenizer_class(model_dir: Path) -> type:
    """The class ``AutoTokenizer`` would pick (``tokenizer_class`` in tokenizer_config.json),
    imported on its own: ``AutoTokenizer`` imports transformers' model configuration code and
    with it torch, which the router process must not load. A folder that names no known class
    gets the generic fast tokenizer, which reads its tokenizer.json."""
    import transformers

    config_file = model_dir / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") or "" if config_file.is_file() else ""
    for candidate in (name, name.removesuffix("Fast")):
        cls = getattr(transformers, candidate, None) if candidate else None
        if isinstance(cls, type):
            return cls
    return transformers.PreTrainedTokenizerFast


class RouterTokenizer:
    def __init__(self, model_dir: str | Path, max_model_len: int | None = None) -> None:
        config = ModelConfig.from_folder(model_dir)
        self.configured_max_model_len = config.context_length(max_model_len)  # refused before the tokenizer loads
        self.max_model_len = self.configured_max_model_len  # held lower while a worker's context is smaller
        self.hf = tokenizer_class(Path(model_dir)).from_pretrained(str(model_dir))
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = config.vocab_size
        self.model_name = config.name
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self.sampling_defaults = generation_defaults(Path(model_dir))

    def hold_to(self, worker_context: int | None, workers: Sequence[str] = ()) -> None:
        """Holds requests to the smallest context a worker reports (None: none says; ``workers``:
        which report it), so that a defaulted ``max_tokens`` fits where the request runs."""
        held = min(self.configured_max_model_len, worker_context or self.configured_max_model_len)
        if held == self.max_model_len:
            return
        if held < self.configured_max_model_len:
            log.warning(
                "requests are held to a context of %d tokens, what %s report(s) (this router's: %d); give "
                "the router and every worker the same --max-model-len",
                held,
                ", ".join(workers) or "a worker",
                self.configured_max_model_len,
            )
        else:
            log.info("requests are held to this router's context of %d tokens again", held)
        self.max_model_len = held

    def encode(self, prompt: str) -> list[int]:
        return self.hf(prompt, add_special_tokens=True)["input_ids"]

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; send a prompt instead")
        ids = self.hf.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def text_stream(self, stop: tuple[str, ...] = (), prompt_ids: list[int] | tuple[int, ...] = ()) -> TextStream:
        return TextStream(self.backend, stop, context_ids=tuple(prompt_ids[-CONTEXT_TOKENS:]))


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults the model ships in generation_config.json (vLLM applies them to
    requests that leave those fields unset); what pdserve cannot apply is named in the log."""
    path = model_dir / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {name: config[name] for name in SAMPLING_DEFAULTS if config.get(name) is not None}
    from pdserve.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)  # checked once here, not refused in every request
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    ignored = {k: v for k in ("repetition_penalty", "min_p") if (v := config.get(k)) not in (None, 1.0, 0.0)}
    if defaults or ignored:
        log.info("sampling defaults from %s: %s", path.name, defaults or "none")
    if ignored:
        log.warning("%s also sets %s, which pdserve does not apply", path.name, ignored)
    return defaults
