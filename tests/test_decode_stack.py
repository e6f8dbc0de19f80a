"""The C++ decode loop gives exactly what the Python model gives; the packed dense kernels match the library GEMM."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_state_dict
from pdserve.engine.packed_linear import BF16_PRODUCTS_MAX_ROWS, PackedLinear, max_kernel_rows, packable
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
    if packed:  # what a decode step streams (wherever a kernel packs it), in one arena
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


# The CPU flags each packed kernel needs (it is compiled in wherever they are): fp32 needs AVX2 and
# FMA; bf16 has products in hardware with AVX512-BF16 and is widened to fp32 with AVX2 and FMA.
_PACKED_NEEDS = {torch.bfloat16: {"avx2", "fma"}, torch.float32: {"avx2", "fma"}}
_BF16_PRODUCTS = {"avx512_bf16", "avx512bw"}
# Decode-sized row counts (tile tails included), a prefill-sized one, and the bf16 products' limit.
_PACKED_CASES = [(dtype, rows) for dtype in _PACKED_NEEDS for rows in (1, 2, 3, 5, 6, 7, 13, 300)] + [
    (torch.bfloat16, BF16_PRODUCTS_MAX_ROWS + extra) for extra in (0, 1)
]


@pytest.mark.parametrize("dtype, rows", _PACKED_CASES)
def test_packed_linear_matches_the_library_gemm(dtype, rows):
    kernels, flags = load(), set(cpu_flags().split())
    if not _PACKED_NEEDS[dtype] <= flags:
        assert not packable(kernels, dtype), "a packed kernel compiled in where the CPU lacks its instructions"
        pytest.skip(reason=f"this CPU lacks {sorted(_PACKED_NEEDS[dtype])}: no packed {dtype} kernel")
    assert packable(kernels, dtype), f"the CPU has {sorted(_PACKED_NEEDS[dtype])}: the kernel must be compiled in"
    if dtype == torch.bfloat16:
        assert kernels.dense_bf16_widened() == (not _BF16_PRODUCTS <= flags)
    limit = max_kernel_rows(kernels, dtype)
    torch.manual_seed(rows)
    dense = torch.nn.Linear(96, 72, bias=True).to(dtype)  # 72 columns: padded to 80 inside
    packed = PackedLinear(dense, kernels)
    logits = PackedLinear(dense, kernels, float_out=True)
    x = torch.randn(rows, 96).to(dtype)
    expected = x.double() @ dense.weight.double().T + dense.bias.double()
    got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 72) and got.is_contiguous()  # 72 of 80 padded columns
    atol, rtol = (2e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    assert logits(x).dtype == torch.float32
    exact = rows <= limit  # the kernel sums exact products in fp32; the library's bf16 GEMM rounds
    torch.testing.assert_close(logits(x).double(), expected, atol=1e-4 if exact else 2e-2, rtol=1e-5 if exact else 1e-2)
    if exact and dtype == torch.bfloat16:  # bf16 out: the fp32 sums rounded to nearest even, as torch rounds
        assert torch.equal(got, logits(x).to(dtype))
    # Where the kernel takes every row count (fp32; bf16 widened), the layer holds only its packed
    # copy; its state_dict still gives the weight as loaded, bit for bit. A kept weight is the loaded one.
    assert (packed.weight is None) == (limit == sys.maxsize)
    assert torch.equal(packed.state_dict()["weight"], dense.weight.detach())
    kept = PackedLinear(dense, kernels, keep_weight=True)
    assert kept.weight.data_ptr() == dense.weight.data_ptr() and torch.equal(kept(x), got)


def in_mapping_of(path, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``tensors`` whose data lies in a mapping of the file ``path``."""
    target, ranges = str(path.resolve()), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(target):
                low, high = line.split()[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return [t for t in tensors if any(low <= t.data_ptr() < high for low, high in ranges)]


def test_weights_view_the_files_mapping_unless_copied(model_dir):
    """A model that keeps its weights as read uses the file's pages (no second copy while loading);
    one whose weights get packed or quantized copies them out, so they do not pin the file."""
    weights_file = model_dir / "model.safetensors"
    viewed = load_state_dict(model_dir, torch.float32)  # the file's own dtype
    assert len(in_mapping_of(weights_file, list(viewed.values()))) == len(viewed)
    copied = load_state_dict(model_dir, torch.float32, copy=True)
    assert not in_mapping_of(weights_file, list(copied.values()))
    assert all(torch.equal(copied[name], tensor) for name, tensor in viewed.items())


def test_an_fp32_model_holds_each_weight_once_and_none_in_the_files_mapping(model_dir):
    """Where fp32's packed kernel is compiled in, a decoder linear holds its packed copy only (the
    tied lm_head's plain weight is the embedding), and no weight views the safetensors file's
    mapping, which would keep every page of the file resident for as long as that weight lives."""
    if not packable(load(), torch.float32):
        pytest.skip(reason="no packed fp32 kernel on this CPU: the model keeps its weights as the file maps them")
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", kv_cache_memory="64MiB", num_threads=2), model_dir=str(model_dir)
    )
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    assert tensors and not in_mapping_of(model_dir / "model.safetensors", tensors)
    linears = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * engine.model_config.num_layers + 1
    assert all(m.weight is None for m in linears if m is not engine.model.lm_head)
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()


def test_the_bf16_hint_is_for_unquantized_fp32_weights_the_bf16_kernel_could_halve():
    kernels = load()
    backend = SimpleNamespace(cpu_kernels=kernels)

    def hint(dtype_flag, quantization, resolved):
        engine = SimpleNamespace(config=SimpleNamespace(dtype=dtype_flag, quantization=quantization), dtype=resolved)
        return LLMEngine._bf16_would_halve_weights(engine, backend)

    assert hint("auto", "none", torch.float32) == packable(kernels, torch.bfloat16)
    assert not hint("auto", "int4", torch.float32)  # its weights are 4-bit codes either way
    assert not hint("float32", "none", torch.float32)  # asked for by name
    assert not hint("auto", "none", torch.bfloat16)
