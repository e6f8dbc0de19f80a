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

from pdserve.engine.quantization import QuantFormat, QuantizedWeight

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


class _UnsupportedGGUF(ValueError):
    """A well-formed GGUF file of something pdserve does not run: its own message says what."""


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise _UnsupportedGGUF(f"unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    name = str(_field(reader, "general.name", "") or "")
    architecture = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in name.lower():
        architecture = "MistralForCausalLM"
    config = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}[
            architecture
        ],
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
        raise _UnsupportedGGUF(
            "GGUF files with precomputed rope_freqs (Llama 3.1 scaling) are not supported; use the Hugging Face folder"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise _UnsupportedGGUF(f"unsupported GGUF rope scaling {scaling!r}")
    return config


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of each head; Hugging Face keeps them apart.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(tensor_name: str, path: str | Path) -> tuple[str, str | None]:
    """(Hugging Face name, llama.cpp layer kind or None for global tensors)."""
    if tensor_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[tensor_name], None
    match = _LAYER_RE.fullmatch(tensor_name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise _UnsupportedGGUF(f"unexpected tensor {tensor_name!r} in {path}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}", kind


def _rotary_heads(config: dict[str, Any], kind: str | None) -> int | None:
    """How many heads' rows llama.cpp interleaved in this tensor (None: not permuted)."""
    if config["model_type"] not in ("llama", "mistral"):
        return None
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(kind)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Returns (Hugging Face config dict, fp32 state dict with Hugging Face names, the native
    codes of every tensor stored in a block format a quantized kernel serves: Q4_0, Q4_1, Q8_0)."""
    try:
        return _read_gguf(path)
    except _UnsupportedGGUF:
        raise
    except (FileNotFoundError, PermissionError, MemoryError):
        raise
    except Exception as e:  # gguf's reader and numpy fail on a cut file with IndexError, reshape errors...
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None


def _read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config = read_config(reader)
    state: dict[str, torch.Tensor] = {}
    native: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name, kind = _hf_name(tensor.name, path)
        heads = _rotary_heads(config, kind)
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            kind_name = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise _UnsupportedGGUF(
                f"{path}: tensor {tensor.name} is stored as {kind_name}, which pdserve cannot read"
            ) from None
        if heads:
            weights = _unpermute_rotary(weights, heads)
        state[name] = torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy
        codes = native_codes(tensor)
        if codes is not None:
            if heads:
                rows = torch.from_numpy(_unpermute_rotary(np.arange(codes.shape[0]), heads).copy())
                codes = codes.rows(rows)
            native[name] = codes
    return config, state, native


# Block formats the quantized kernels serve: bytes per block of 32 values.
_Q4_0, _Q4_1, _Q8_0 = 18, 20, 34


def native_codes(tensor) -> QuantizedWeight | None:
    """A Q4_0/Q4_1/Q8_0 tensor's codes and scales, exactly as stored (None for other types)."""
    from gguf import GGMLQuantizationType as T

    kind = tensor.tensor_type
    block = {T.Q4_0: _Q4_0, T.Q4_1: _Q4_1, T.Q8_0: _Q8_0}.get(kind)
    if block is None:
        return None
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == T.Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = -128 * d
        fmt = QuantFormat.INT8_GROUP
    else:
        start = 4 if kind == T.Q4_1 else 2
        packed = blocks[..., start:]
        # Element j of a block is the low nibble of byte j; element j + 16 its high nibble.
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == T.Q4_1 else -8 * d
        fmt = QuantFormat.INT4_GROUP
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))),
        torch.from_numpy(d),
        torch.from_numpy(np.ascontiguousarray(m)),
        fmt,
    )
