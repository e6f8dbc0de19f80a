"""The C++ decode loop and the packed bf16 kernel give exactly what the Python model gives."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.packed_linear import MAX_KERNEL_ROWS, PackedBF16Linear
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.cpu_extension import cpu_flags, load

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "dtype, quantization, kv_cache_dtype",
    [
        ("bfloat16", "none", "auto"),
        ("bfloat16", "int4", "int8"),
        ("float32", "none", "auto"),
        ("float32", "int8", "fp8"),
    ],
)
def test_decode_stack_is_bitwise_the_python_model(model_dir, dtype, quantization, kv_cache_dtype):
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory="128MiB",
            num_threads=2,
        ),
        model_dir=str(model_dir),
    )
    assert engine.model.decode_stack is not None
    packed = [m.packed for m in engine.model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    kernel_packs = "avx512_vnni" in cpu_flags() if quantization != "none" else "avx512_bf16" in cpu_flags()
    if kernel_packs and (dtype == "bfloat16" or quantization != "none"):  # what a decode step streams, in one arena
        assert len(packed) == 4 * engine.model_config.num_layers + 1
        assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
    for i, length in enumerate((5, 40, 97)):  # contexts of different lengths and block counts
        engine.add_request(
            f"r{i}",
            [1000 + (i * 31 + j) % 30000 for j in range(length)],
            SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
        )
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    batch = engine.runner.build_batch(engine.scheduler.schedule())
    assert batch.num_decode == batch.num_tokens == 3
    before = engine.kv_cache.tensor.clone()
    with_stack = engine.model(batch, engine.kv_cache.layers)
    written_by_stack = engine.kv_cache.tensor.clone()
    engine.kv_cache.tensor.copy_(before)
    stack, engine.model.decode_stack = engine.model.decode_stack, None
    python = engine.model(batch, engine.kv_cache.layers)
    engine.model.decode_stack = stack
    assert torch.equal(with_stack, python)
    assert torch.equal(written_by_stack, engine.kv_cache.tensor)  # the same K/V landed in the cache


@pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16 (the packed kernel is not compiled in)"
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1])
def test_packed_bf16_linear_matches_onednn(rows):
    kernels = load()
    assert kernels.has_dense_bf16(), "the CPU has AVX512-BF16: the packed kernel must be compiled in"
    torch.manual_seed(rows)
    dense = torch.nn.Linear(96, 72, bias=True).to(torch.bfloat16)  # 72 columns: padded to 80 inside
    packed = PackedBF16Linear(dense, kernels)
    logits = PackedBF16Linear(dense, kernels, float_out=True)
    x = torch.randn(rows, 96).bfloat16()
    expected = x.float() @ dense.weight.float().T + dense.bias.float()
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 72)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)
    assert logits(x).dtype == torch.float32
    torch.testing.assert_close(logits(x), expected, atol=2e-2 if rows > MAX_KERNEL_ROWS else 1e-4, rtol=1e-2)
