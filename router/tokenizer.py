"""The router's tokenizer: prompts and chat messages to ids, ids back to streamed text."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.engine.model_config import ModelConfig
from pdserve.router.text_stream import CONTEXT_TOKENS, TextStream


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
    def __init__(self, model_dir: str | Path) -> None:
        self.hf = tokenizer_class(Path(model_dir)).from_pretrained(str(model_dir))
        self.backend = self.hf.backend_tokenizer
        config = ModelConfig.from_folder(model_dir)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position
        self.model_name = config.name
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

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
