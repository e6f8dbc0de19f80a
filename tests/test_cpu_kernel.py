"""The C++ CPU decode-attention kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference, select_backend
from pdserve.kernels.cpu_extension import load


@pytest.fixture(scope="module")
def kernel():
    module = load()
    assert module is not None, "the C++ kernel must build on this machine (gcc and ninja are installed)"
    return module


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_matches_reference(kernel, dtype, atol, num_q_heads, num_kv_heads, block_size):
    torch.manual_seed(block_size * 100 + num_q_heads)
    head_dim, num_blocks, batch = 64, 80, 5
    kv = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor([1, block_size, block_size + 3, 7 * block_size - 1, 9 * block_size])
    max_blocks = int(-(-lens.max() // block_size))
    # Shuffled, non-contiguous block tables; padding entries point at arbitrary valid blocks.
    tables = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=dtype)
    expected = reference.paged_decode_attention(q, kv, tables, lens, head_dim**-0.5)
    got = kernel.paged_decode_attention(q, kv, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def test_auto_backend_on_cpu_uses_it(kernel):
    assert select_backend(torch.device("cpu"), "auto").name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="attention backend"):
        select_backend(torch.device("cpu"), "magic")
