"""The architecture of a LLaMA-family model, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _positive(cfg: dict[str, Any], key: str, value: Any) -> float:
    """A positive finite number field (given ``value``, its default when absent)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"config.json: {key!r} must be a positive number, got {value!r}")
    return float(value)


def _count(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A required (or defaulted) positive integer field, or a ValueError naming it."""
    value = cfg.get(key)
    if value is None:  # absent or null: the default, where there is one
        value = default
    if value is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_proj_bias: bool  # Llama with attention_bias (Qwen2 has none on o_proj)
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def context_length(self, max_model_len: int | None) -> int:
        """The context served: the model's own, or the ``max_model_len`` setting below it (the
        engine and the router both hold requests to it)."""
        if max_model_len is None:
            return self.max_position
        if not 2 <= max_model_len <= self.max_position:
            raise ValueError(
                f"max_model_len: {max_model_len} must be in [2, {self.max_position}] (the model's context)"
            )
        return max_model_len

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token across all layers, in elements (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], *, name: str = "") -> "ModelConfig":
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or [_ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", "llama"), "")]
        arch = archs[0] if isinstance(archs, list) else archs
        if not isinstance(arch, str):
            raise ValueError(f"config.json: 'architectures' must be a list of names, got {cfg.get('architectures')!r}")
        if arch not in SUPPORTED_ARCHITECTURES:
            named = arch or f"model_type {cfg.get('model_type')!r}"
            raise ValueError(f"unsupported architecture {named!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = _count(cfg, "num_attention_heads")
        hidden_size = _count(cfg, "hidden_size")
        head_dim = _count(cfg, "head_dim") if cfg.get("head_dim") else hidden_size // num_heads
        if not head_dim:
            raise ValueError(
                f"config.json: hidden_size ({hidden_size}) is smaller than num_attention_heads ({num_heads})"
            )
        # transformers 5 moves rope_theta/rope_scaling into rope_parameters.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        max_position = _count(cfg, "max_position_embeddings", 4096)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True):
            # Sliding-window attention is not implemented: keep every context inside one window,
            # where it equals full attention.
            max_position = min(max_position, window)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=_count(cfg, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_count(cfg, "intermediate_size"),
            num_layers=_count(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_count(cfg, "num_key_value_heads", num_heads) if cfg.get("num_key_value_heads") else num_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(cfg, "rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_positive(cfg, "rope_theta", rope_theta),
            max_position=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
            raw=cfg,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        cfg = _read_json(folder / "config.json")
        gen_path = folder / "generation_config.json"
        # generate() stops at the generation config's EOS ids, and vLLM at the tokenizer's EOS
        # too (a fine-tune may set <|im_end|> there alone); so do we.
        extra = [_read_json(gen_path).get("eos_token_id") if gen_path.exists() else None, _tokenizer_eos(folder)]
        extra = [e for value in extra for e in (value if isinstance(value, list) else [value]) if e is not None]
        if extra:
            merged = [cfg.get("eos_token_id")] if not isinstance(cfg.get("eos_token_id"), list) else cfg["eos_token_id"]
            cfg = {**cfg, "eos_token_id": [e for e in dict.fromkeys([*merged, *extra]) if e is not None]}
        try:
            return cls.from_dict(cfg, name=folder.name)
        except ValueError as e:
            raise ValueError(f"{folder}/{e}" if str(e).startswith("config.json") else f"{folder}: {e}") from None


def _tokenizer_eos(folder: Path) -> int | None:
    """The id of tokenizer_config.json's ``eos_token``, looked up in tokenizer.json (None if either is missing)."""
    config, vocabulary = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config.exists() and vocabulary.exists()):
        return None
    eos = _read_json(config).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    tokenizer = _read_json(vocabulary)
    for added in tokenizer.get("added_tokens") or ():
        if isinstance(added, dict) and added.get("content") == eos and isinstance(added.get("id"), int):
            return added["id"]
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    found = vocab.get(eos) if isinstance(vocab, dict) else None  # a Unigram vocabulary is a list: added tokens only
    return found if isinstance(found, int) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # a missing file stays FileNotFoundError
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
