"""Weight-only quantized linear layers: int8 (per output channel) and int4 (groups of 32).

A quantized weight is a matrix of unsigned codes plus scales, ``w = d * q + m``:
- ``int8``: per output channel, symmetric: ``q = round(w / s) + 128``, ``d = s``, ``m = -128 s``
  (one scale per row; the kernel applies it once per output);
- ``int4``: per group of 32 inputs, asymmetric: ``q in [0, 15]``, ``d = (max - min) / 15``,
  ``m = min`` (GGUF's Q4_1; Q4_0 is the special case ``m = -8 d``);
- ``int8g``: per group of 32, symmetric (GGUF's Q8_0, which the default model's embedding is).

On CPU the codes are packed for the C++ kernel (``kernels/csrc/quant_linear_cpu.cpp``), which
quantizes activations per group of 32 on the fly and computes int8 dot products (AVX512-VNNI,
or AVX2 on CPUs without it). Elsewhere (CUDA, or a CPU where the kernel does not build) the layer
dequantizes its weight and runs a plain matmul: slower, but the same weights.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pdserve.engine.engine_config import QUANTIZATIONS

log = logging.getLogger(__name__)
GROUP = 32  # K values per scale group
COLUMN_BLOCK = 16  # the CPU kernel's column tile


class QuantFormat(enum.IntEnum):
    """Code layouts; values match the C++ kernel's ``Format``."""

    INT8_CHANNEL = 0
    INT8_GROUP = 1
    INT4_GROUP = 2

    @property
    def bits(self) -> int:
        return 4 if self is QuantFormat.INT4_GROUP else 8


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """Codes and scales of one [N, K] weight, unpacked (the form files and tests use).

    ``codes``: uint8 [N, K]; ``scale``, ``offset``: float32 [N, K/32] for group formats, or
    [N] (per channel) for INT8_CHANNEL, where the offset is implied (-128 * scale).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    fmt: QuantFormat

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.codes.to(torch.float32)
        if self.fmt is QuantFormat.INT8_CHANNEL:
            return ((q - 128) * self.scale[:, None]).to(dtype)
        w = q.view(n, k // GROUP, GROUP) * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """A subset of output rows (e.g. to undo a row permutation)."""
        return QuantizedWeight(self.codes[index], self.scale[index], self.offset[index], self.fmt)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stacks weights along the output dimension (q/k/v -> qkv)."""
        fmts = {p.fmt for p in parts}
        if len(fmts) != 1:
            raise ValueError(f"cannot stack weights quantized differently: {sorted(f.name for f in fmts)}")
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            parts[0].fmt,
        )


def quantize_int8_channel(w: torch.Tensor) -> QuantizedWeight:
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127) + 128
    return QuantizedWeight(q.to(torch.uint8), scale, -128 * scale, QuantFormat.INT8_CHANNEL)


def check_groups(in_features: int) -> None:
    if in_features % GROUP:
        raise ValueError(f"in_features must be a multiple of {GROUP} to quantize, got {in_features}")


def quantize_int4_group(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    check_groups(k)
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    # Scales are kept in fp16 by the kernel: quantize against the rounded values.
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((g - m[..., None]) / safe[..., None]).clamp(0, 15)
    return QuantizedWeight(q.view(n, k).to(torch.uint8), d, m, QuantFormat.INT4_GROUP)


def quantize(w: torch.Tensor, mode: str) -> QuantizedWeight:
    if mode == "int8":
        return quantize_int8_channel(w)
    if mode == "int4":
        return quantize_int4_group(w)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS[1:])}, got {mode!r}")


BEST_PATH = -1  # quant_linear's fastest path compiled in here (AVX512-VNNI, else AVX2)


def cpu_kernels():
    """The compiled CPU kernels if they have a vector quantized path here, else None."""
    from pdserve.kernels import cpu_extension

    module = cpu_extension.load()
    return module if module is not None and max(module.quant_paths()) > 0 else None


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` quantized. ``use_kernel``: the packed CPU kernel (default:
    when the weight is on the CPU and the kernel has its fast path here)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        device: torch.device,
        use_kernel: bool | None = None,
        float_out: bool = False,
    ) -> None:
        """``float_out``: return fp32 whatever the input dtype (the lm_head's logits)."""
        super().__init__()
        n, k = weight.shape
        check_groups(k)
        self.in_features, self.out_features, self.fmt, self.float_out = k, n, weight.fmt, float_out
        kernels = cpu_kernels() if device.type == "cpu" else None
        self.kernels = kernels if (use_kernel is None or use_kernel) else None
        if use_kernel and self.kernels is None:
            raise ValueError("the quantized CPU kernel is not available on this machine")
        if self.kernels is not None:
            padded = -(-n // COLUMN_BLOCK) * COLUMN_BLOCK
            w = _pad_rows(weight, padded)
            self.padded_out = padded
            packed = self.kernels.pack_weights(w.codes.contiguous(), w.scale, w.offset, int(w.fmt))
            self.register_buffer("packed", packed)
            col_scale = w.scale.float().contiguous() if w.fmt is QuantFormat.INT8_CHANNEL else torch.empty(0)
            self.register_buffer("col_scale", col_scale)
            # The kernel adds the bias (fp32, padded like the columns) as it stores each result.
            self.register_buffer("bias", F.pad(bias.float(), (0, padded - n)) if bias is not None else torch.empty(0))
        else:
            self.padded_out = n
            self.register_buffer("bias", bias.to(device) if bias is not None else None)
            self.register_buffer("codes", weight.codes.to(device))
            self.register_buffer("scale", weight.scale.to(device))
            self.register_buffer("offset", weight.offset.to(device))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense matrix (the fallback path; also for tests)."""
        if self.kernels is not None:
            raise RuntimeError("a packed layer keeps no unpacked codes")
        return QuantizedWeight(self.codes, self.scale, self.offset, self.fmt).dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernels is not None:
            y = self.kernels.quant_linear(
                x2,
                self.packed,
                self.col_scale,
                self.bias,
                self.padded_out,
                self.in_features,
                int(self.fmt),
                BEST_PATH,
                self.float_out,
            )
            if self.padded_out != self.out_features:
                y = y[:, : self.out_features]
        else:
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            y = F.linear(x2, self.dequantized_weight(x.dtype), bias)
            y = y.float() if self.float_out else y
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "cpu kernel" if self.kernels is not None else "dequantize + matmul"
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.name.lower()}, {path}"


def _pad_rows(w: QuantizedWeight, rows: int) -> QuantizedWeight:
    n = w.shape[0]
    if rows == n:
        return w
    pad = rows - n
    codes = torch.cat([w.codes, torch.zeros(pad, w.codes.shape[1], dtype=w.codes.dtype)])
    return QuantizedWeight(
        codes,
        F.pad(w.scale, (0, 0, 0, pad)) if w.scale.dim() == 2 else F.pad(w.scale, (0, pad)),
        F.pad(w.offset, (0, 0, 0, pad)) if w.offset.dim() == 2 else F.pad(w.offset, (0, pad)),
        w.fmt,
    )


def save_codes(weights: dict[str, QuantizedWeight], path: Path) -> None:
    """Writes quantized weights as safetensors: ``NAME.codes/.scale/.offset`` plus each format."""
    tensors = {}
    for name, w in weights.items():
        tensors[f"{name}.codes"] = w.codes.contiguous()
        tensors[f"{name}.scale"] = w.scale.float().contiguous()
        tensors[f"{name}.offset"] = w.offset.float().contiguous()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    formats = json.dumps({name: w.fmt.name for name, w in weights.items()})
    save_file(tensors, str(path), metadata={"formats": formats})


def load_codes(path: Path) -> dict[str, QuantizedWeight]:
    """The inverse of ``save_codes``; {} when there is no such file."""
    if not Path(path).is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        return {
            name: QuantizedWeight(
                f.get_tensor(f"{name}.codes"),
                f.get_tensor(f"{name}.scale"),
                f.get_tensor(f"{name}.offset"),
                QuantFormat[fmt],
            )
            for name, fmt in formats.items()
        }
