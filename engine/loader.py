"""Builds a ``CausalLM`` from a Hugging Face folder (safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model import CausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.kernels import AttentionBackend

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Our stacked layers and the checkpoint layers they hold, in order.
STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX), else float16 on GPUs and float32 on CPUs."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(set(DTYPES))}, got {name!r}")
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is for GPUs; on CPU use bfloat16 or float32")
    return dtype


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def load_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    state[name] = f.get_tensor(name).to(dtype)
    return state


def stack_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenates each layer's q/k/v and gate/up weights (and biases) into the stacked layers."""
    for name in [n for n in state if n.endswith(".self_attn.q_proj.weight")]:
        layer = name[: -len(".self_attn.q_proj.weight")]
        for stacked, parts in STACKED.items():
            for kind in ("weight", "bias"):
                keys = [f"{layer}.{part}.{kind}" for part in parts]
                present = [k in state for k in keys]
                if all(present):
                    state[f"{layer}.{stacked}.{kind}"] = torch.cat([state.pop(k) for k in keys])
                elif any(present):
                    raise ValueError(f"checkpoint has only some of {keys}")
    return state


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> CausalLM:
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(config, backend)
    state = stack_checkpoint(load_state_dict(folder, dtype))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"weights in {folder} do not fit {config.architecture}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers are not in the checkpoint: build them for real, off the meta device.
    model.rope = type(model.rope)(config)
    return model.to(device).eval()
