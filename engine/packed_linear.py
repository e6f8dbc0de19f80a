"""Dense linear layers for decode-sized inputs on CPUs: a packed kernel for few rows.

oneDNN's and MKL's GEMMs are the right tool for prefill (hundreds of rows) but stream a weight
at a fraction of the memory bandwidth for the one to a few dozen rows of a decode step, which is
memory-bound. The layer keeps a column-interleaved copy for ``kernels/csrc/dense_linear_cpu.cpp``
(bf16 on AVX512-BF16 or, widened to fp32, on AVX2; fp32 on AVX2); each call picks by row
count: the packed kernel up to ``max_kernel_rows`` rows, the library above, which needs the
weight as loaded too. Where the kernel serves every row count (fp32, and bf16 on a CPU without
bf16 products, whose library GEMM is far slower), the layer holds the packed copy only (its
``state_dict`` still gives the weight as loaded).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.quantization import COLUMN_BLOCK

# Rows up to which the AVX512-BF16 kernel beats oneDNN's bf16 GEMM (measured: bench/RESULTS.md).
BF16_PRODUCTS_MAX_ROWS = 32


def max_kernel_rows(kernels, dtype: torch.dtype) -> int:
    """Rows up to which the packed kernel beats the library GEMM: every row count measured
    (1-512) for fp32, and for bf16 widened to fp32 (torch's bf16 GEMM runs below 1 GFLOP/s
    on a CPU without bf16 products)."""
    if dtype == torch.bfloat16 and not kernels.dense_bf16_widened():
        return BF16_PRODUCTS_MAX_ROWS
    return sys.maxsize


def packable(kernels, dtype: torch.dtype) -> bool:
    """Whether ``kernels`` (the compiled CPU kernels, or None) have a packed kernel for ``dtype``."""
    return kernels is not None and str(dtype).removeprefix("torch.") in kernels.dense_dtypes()


def packed_only(kernels, dtype: torch.dtype) -> bool:
    """Whether a packed layer of ``dtype`` holds its packed copy only: its kernel serves every row
    count, so no library GEMM needs the weight as loaded."""
    return packable(kernels, dtype) and max_kernel_rows(kernels, dtype) == sys.maxsize


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels, float_out: bool = False, keep_weight: bool = False) -> None:
        """``float_out``: return fp32 (the lm_head's logits). ``keep_weight``: hold the weight as
        loaded even where the kernel serves every row count (a tied lm_head's weight is the
        embedding's, so holding it costs nothing)."""
        super().__init__()
        weight = linear.weight.detach()
        if weight.device.type != "cpu" or not packable(kernels, weight.dtype):
            raise ValueError(f"no packed kernel for {weight.dtype} weights on {weight.device} here")
        self.out_features, self.in_features = weight.shape
        self.kernels, self.float_out = kernels, float_out
        self.max_kernel_rows = max_kernel_rows(kernels, weight.dtype)
        self.padded_out = -(-self.out_features // COLUMN_BLOCK) * COLUMN_BLOCK
        self.register_buffer("weight", weight if keep_weight or not packed_only(kernels, weight.dtype) else None)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)
        pad = self.padded_out - self.out_features
        padded = F.pad(weight, (0, 0, 0, pad)) if pad else weight.contiguous()  # F.pad copies even by 0
        self.register_buffer("packed", kernels.pack_dense(padded))
        bias = self.bias.float() if self.bias is not None else torch.zeros(0)
        self.register_buffer(
            "kernel_bias", F.pad(bias, (0, self.padded_out - self.out_features)) if bias.numel() else bias
        )

    def loaded_weight(self) -> torch.Tensor:
        """The [out, in] weight as loaded: held, or unpacked from the kernel's copy."""
        if self.weight is not None:
            return self.weight
        return self.kernels.unpack_dense(self.packed)[: self.out_features]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None:
            destination[prefix + "weight"] = self.loaded_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.weight is None or (x2.shape[0] <= self.max_kernel_rows and x2.dtype == self.weight.dtype):
            y = self.kernels.dense_linear(x2, self.packed, self.kernel_bias, self.padded_out, self.float_out)
            if self.padded_out != self.out_features:
                y = y[:, : self.out_features].contiguous()  # the fused norms take contiguous rows
        else:
            y = F.linear(x2, self.weight, self.bias)
            y = y.float() if self.float_out else y
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = "all rows" if self.max_kernel_rows == sys.maxsize else f"<= {self.max_kernel_rows} rows"
        return f"in={self.in_features}, out={self.out_features}, {self.packed.dtype} packed ({rows}) / library GEMM"
