"""The router's tokenizer: prompts and chat messages to ids, ids back to streamed text."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.model_config import ModelConfig
from pdserve.router.text_stream import TextStream

CHAT_ROLES = ("system", "user", "assistant", "tool")


class RouterTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.backend = self.hf.backend_tokenizer
        config = ModelConfig.from_folder(model_dir)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position
        self.model_name = config.name
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, prompt: str) -> list[int]:
        return self.hf(prompt, add_special_tokens=True)["input_ids"]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; send a prompt instead")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def text_stream(self, stop: tuple[str, ...] = ()) -> TextStream:
        return TextStream(self.backend, stop)
