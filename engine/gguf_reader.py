"""Reads a LLaMA-family GGUF file into a Hugging Face config and fp32 state dict.

The ``gguf`` package parses and dequantizes; this module maps llama.cpp's names onto
Hugging Face's and undoes llama.cpp's rotary permutation of the q/k projections.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    name = str(_field(reader, "general.name", "") or "")
    architecture = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in name.lower():
        architecture = "MistralForCausalLM"
    config = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}[architecture],
        "vocab_size": _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with precomputed rope_freqs (Llama 3.1 scaling) are not supported; use the Hugging Face folder")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    return config


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head; Hugging Face keeps them apart.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Returns (Hugging Face config dict, fp32 state dict with Hugging Face names)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config = read_config(reader)
    permute = config["model_type"] in ("llama", "mistral")
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        if tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        else:
            match = _LAYER_RE.fullmatch(tensor.name)
            if not match or match.group(2) not in _LAYER_NAMES:
                raise ValueError(f"unexpected tensor {tensor.name!r} in {path}")
            layer, kind, suffix = match.groups()
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
            if permute and kind == "attn_q":
                weights = _unpermute_rotary(weights, config["num_attention_heads"])
            elif permute and kind == "attn_k":
                weights = _unpermute_rotary(weights, config["num_key_value_heads"])
        state[name] = torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy
    return config, state
