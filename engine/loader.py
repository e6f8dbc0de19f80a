"""Builds a ``CausalLM`` from a Hugging Face folder (safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.decode_stack import build_decode_stack
from pdserve.engine.host_memory import host_arena, trim_heap
from pdserve.engine.model import CausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_store import NATIVE_CODES
from pdserve.engine.packed_linear import PackedLinear, packable, packed_only
from pdserve.engine.quantization import QuantFormat, QuantizedLinear, QuantizedWeight, load_codes, quantize
from pdserve.kernels import AttentionBackend, select_layer_ops

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Our stacked layers and the checkpoint layers they hold, in order.
STACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


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
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device: {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {e!r}") from None
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def load_state_dict(folder: Path, dtype: torch.dtype, copy: bool = False) -> dict[str, torch.Tensor]:
    """``copy``: copy tensors of the file's own dtype too. Uncopied, they view the file's mapping,
    which then stays mapped and resident while any one of them lives: right when the model keeps
    them all, a second copy of the file when most are replaced (packed or quantized)."""
    state = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        state[name] = f.get_tensor(name).to(dtype, copy=copy)
        except (OSError, MemoryError):
            raise
        except Exception as e:  # safetensors' own error is no ValueError: name the file it is about
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
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


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    quantization: str = "none",
    shard=None,
) -> CausalLM:
    """``shard``: this rank's part of a tensor/pipeline-parallel model (``engine.parallel.sharding.ModelShard``)."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(shard.local_config() if shard else config, backend, select_layer_ops(device))
        if shard:
            shard.prune(model)
    replaced = device.type == "cpu" and (quantization != "none" or packed_only(backend.cpu_kernels, dtype))
    state = stack_checkpoint(load_state_dict(folder, dtype, copy=replaced))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if shard:
        state = shard.shard_state(state)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"weights in {folder} do not fit {config.architecture}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    del state  # the model holds the weights now: packing may free the plain ones
    if config.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    if quantization != "none":
        # A GGUF's own blocks hold whole tensors: a shard quantizes its slices instead.
        quantize_model(model, quantization, {} if shard else load_codes(folder / NATIVE_CODES), device)
    elif device.type == "cpu" and packable(backend.cpu_kernels, dtype):
        pack_dense_model(model, backend.cpu_kernels)
    if device.type == "cpu":
        packed_onto_huge_pages(model)
    if shard is None and backend.cpu_kernels is not None and model.ops.name == "cpu" and backend.kv_format is not None:
        model.decode_stack = build_decode_stack(model, backend.cpu_kernels, backend.kv_format.kind)
    return model


# The GGUF block format each requested quantization keeps as is (others are re-quantized).
_NATIVE_FORMAT = {"int4": QuantFormat.INT4_GROUP, "int8": QuantFormat.INT8_GROUP}
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_model(model: CausalLM, mode: str, native: dict[str, QuantizedWeight], device: torch.device) -> None:
    """Replaces every decoder linear layer and the lm_head by a quantized one, in place.

    A GGUF's own blocks are kept where they match ``mode`` (Q4_0/Q4_1 for int4, Q8_0 for int8);
    other weights are quantized from the loaded ones. The lm_head stays at 8 bits (the GGUF's
    Q8_0 embedding, else int8 per channel): 4-bit logits cost more quality than the bytes they
    save. The embedding lookup stays in the model dtype (it reads one row per token).
    """
    for i, layer in enumerate(model.model.layers):
        for path in _LINEARS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            parts = [native.get(f"model.layers.{i}.{part}.weight") for part in STACKED.get(path, (path,))]
            if all(p is not None and p.fmt is _NATIVE_FORMAT[mode] for p in parts):
                weight = QuantizedWeight.cat(parts)  # type: ignore[arg-type]
            else:
                weight = quantize(linear.weight.detach().cpu(), mode)
            bias = linear.bias.detach() if linear.bias is not None else None
            setattr(owner, attr, QuantizedLinear(weight, bias, device))
    if model.lm_head is None:  # a pipeline stage before the last
        return
    head = native.get("lm_head.weight")
    if head is None and model.config.tie_word_embeddings:
        head = native.get("model.embed_tokens.weight")
    if head is None or head.fmt is not QuantFormat.INT8_GROUP:
        head = quantize(model.lm_head.weight.detach().cpu(), "int8")
    model.lm_head = QuantizedLinear(head, None, device, float_out=True)


def packed_onto_huge_pages(model: CausalLM) -> None:
    """Moves the decode kernels' packed weights (what a decode step streams) into one arena on
    2 MB pages (``host_arena``), in layer order."""
    owners = [m for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    if not owners:  # no decode kernels here (fp32 weights, or a CPU without them)
        return
    for owner, packed in zip(owners, host_arena([m.packed for m in owners])):
        owner.packed = packed
    trim_heap()  # the packed copies just freed


def pack_dense_model(model: CausalLM, kernels) -> None:
    """Gives every decoder linear layer and the lm_head the packed decode kernel, in place."""
    for layer in model.model.layers:
        for path in _LINEARS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            setattr(owner, attr, PackedLinear(getattr(owner, attr), kernels))
    if model.lm_head is not None:
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        model.lm_head = PackedLinear(model.lm_head, kernels, float_out=True, keep_weight=tied)
